/* Causal GQA flash attention on the tensor cores (bf16 mma.sync m16n8k16, fp32 accumulation), for
 * sm_80 and later; same contract as ops.h's attention_forward / attention_backward. Handles bf16
 * with head_dim 64 or 128 and 16-byte-aligned tensors; everything else is left to the fp32
 * CUDA-core kernels of attention.cu (attention_tc.cu says how the kernels work).
 *
 * The plain C entry points (the unit tests and tools/bench_attention.c call them) need the CUDA
 * backend initialised (backend_cuda()) and run on its stream:
 *   attention_tc_forward / _backward   the tensor-core kernels; return false, having done
 *                                      nothing, when the case is outside what they handle.
 *   attention_simt_forward / _backward the fp32 CUDA-core kernels on bf16 tensors (what the bf16
 *                                      backend ran before), kept callable for comparison.
 * The C++ templates below are what backend_cuda.cu puts in its table: bf16 tries the tensor-core
 * kernels first, float always takes the CUDA-core kernels. */
#ifndef MT_CUDA_ATTENTION_TC_CUH
#define MT_CUDA_ATTENTION_TC_CUH

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out, q: [B,S,Hq,D] bf16; k, v: [B,S,Hkv,D] bf16; lse: [B,Hq,S] fp32 */
bool attention_tc_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B,
                          int S, int Hq, int Hkv, int D);
/* dq: [B,S,Hq,D], dk, dv: [B,S,Hkv,D] (overwritten); dout, out: [B,S,Hq,D]; lse from the forward */
bool attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                           const void *k, const void *v, const void *out, const float *lse, int B,
                           int S, int Hq, int Hkv, int D);
/* the same with work (work_bytes) lent for the stored dS tiles (used when at least
 * attention_tc_ds_bytes; else the backend's scratch) */
bool attention_tc_backward_work(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                const void *k, const void *v, const void *out, const float *lse,
                                int B, int S, int Hq, int Hkv, int D, void *work, size_t work_bytes);
/* the bytes the stored dS tiles of a backward take */
size_t attention_tc_ds_bytes(int B, int S, int Hq);

void attention_simt_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                            int B, int S, int Hq, int Hkv, int D);
void attention_simt_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                             const void *k, const void *v, const void *out, const float *lse,
                             int B, int S, int Hq, int Hkv, int D);

/* The backend's stream (a cudaStream_t), for callers that time work around these. */
void *attention_tc_stream(void);

/* Selects the forward kernel for tests and benchmarks: mma.sync tilings 0 = 32 query rows per
 * warp × 4 warps, 1 = 16 × 4, 2 = 16 × 8; wgmma (Hopper only, else 0 runs) 3, 4, 5, 6 = warpgroups
 * × keys per tile 2 × 128, 2 × 64, 1 × 64, 3 × 64; TMA producer + two wgmma warpgroups 7, 8 = a
 * producer warp, 64-key tiles, 4 or 6 stages; 9, 10 = a producer warpgroup, 128-key tiles, 2 or 3
 * stages; 11 = a producer warpgroup, 64-key tiles, 4 stages; -1 (the default) = 10 on Hopper, 0
 * elsewhere. Out-of-range values change nothing. Returns the previous one.
 * Not thread-safe: call it between ops. */
int attention_tc_set_variant(int fwd);

/* Selects the backward kernels for tests and benchmarks: variant = dkdv + ATTN_BWD_KINDS·dq, each
 * 0 = the mma.sync kernel, 1 = warp-specialised wgmma (TMA producer warpgroup, two wgmma
 * warpgroups); 1 + 2·1 was the default before ATTN_BWD_DS. On a GPU other than sm_90, or with MT_FORCE_SM80=1, the
 * mma.sync kernels run whatever is selected. All give the same bits (with one dK/dV part,
 * attention_tc_set_dkdv_parts).
 * Out-of-range values change nothing. Returns the previous one. Not thread-safe. */
enum { ATTN_BWD_KINDS = 2 };
/* ... and ATTN_BWD_DS (the default on Hopper): the warp-specialised passes with 5 products, the
 * dK/dV pass storing each dS tile (bf16) for the dQ pass (attention_tc_ds_bytes of scratch) */
enum { ATTN_BWD_DS = ATTN_BWD_KINDS * ATTN_BWD_KINDS, ATTN_BWD_VARIANTS };
int attention_tc_set_bwd_variant(int variant);
/* The warp-specialised dK/dV pass in parts of each kv group's query heads (src/attention_parts.h):
 * 0 = the rule there (the default), n >= 1 = the largest count <= n that divides the group, -1 =
 * MT_ATTN_DKDV_PARTS, or the rule where that is unset. With more than one part dK and dV are sums
 * of the parts' fp32 sums, other bits than the mma.sync kernels' (the same run to run). Returns
 * the previous setting. Not thread-safe. */
int attention_tc_set_dkdv_parts(int parts);
/* The dQ pass from the stored dS (ATTN_BWD_DS) is persistent: 0 = a CTA an SM (the default), n > 0
 * = at most n CTAs, each walking the 128-query blocks in rounds; -1 = a CTA a block, as before
 * (MT_ATTN_DQ_BLOCKS=1). The same bits whichever. Returns the previous setting. Not thread-safe. */
int attention_tc_set_dq_ctas(int ctas);

#ifdef __cplusplus
}

/* seg != nullptr (document masking): the tensor-core kernels mask keys of other documents per
 * score (in every tile, not only those on the diagonal); the backward then runs the mma.sync
 * kernels, since the wgmma ones know only the causal mask. */
template <typename T>
void cu_attention_tc_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                             int B, int S, int Hq, int Hkv, int D, const int32_t *seg);
template <typename T>
void cu_attention_tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const float *lse,
                              int B, int S, int Hq, int Hkv, int D, const int32_t *seg, void *work,
                              size_t work_bytes);
#endif

#endif
