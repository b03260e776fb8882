/* The compute ops, forward and backward, behind a backend table. Model, MoE, pipeline and the train
 * loop call ops only through `struct backend`; src/cpu/ (fp32 reference) and cuda/ (bf16 + fp32
 * accumulation) each fill one.
 *
 * Pointer conventions:
 *   void *  "X" tensors: the backend's compute dtype (fp32 on the CPU; bf16 or fp32 on CUDA per
 *           model.precision), living in the backend's memory.
 *   float * always fp32 (statistics, weight gradients, master weights, Adam moments).
 *   int32_t * indices.
 * Weight gradients (dw) are ACCUMULATED (+=) so micro-batches sum into one fp32 buffer. Input
 * gradients (din) are overwritten unless the op takes an `accumulate` flag that is true.
 * Linear weights use PyTorch layout W[out, in]; matmul computes y = x Wᵀ.
 * Every op is asynchronous on its backend's current stream; only `sync` and the to_host copies wait. */
#ifndef MT_OPS_H
#define MT_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MT_IGNORE_INDEX (-100)
/* An empty routing slot (sorts after every expert id) */
#define MT_NO_EXPERT INT32_MAX

/* How the router turns logits into a routing (docs/router.md; model.* keys of the same names).
 * Qwen3-MoE: softmax, no groups, route_scale 1. Passed by value-pointer to the router ops: the
 * struct is plain data (the CUDA side reads it on the host and passes the fields to its kernels). */
struct router_opts {
    bool sigmoid;            /* scores = sigmoid(logits) instead of softmax(logits) */
    bool norm_topk;          /* the chosen weights are renormalised to sum 1 */
    float route_scale;       /* the chosen weights × this, after the renormalisation */
    int n_group;             /* experts in n_group equal groups (1 = no groups) */
    int topk_group;          /* only the best topk_group groups compete (n_group = off) */
    bool force_balance;      /* round-robin experts, for benchmarking only */
};

/* One run of parameters for adamw_update_multi: the arrays adamw_update (or adamw_update_m16)
 * takes, offset to the run's start (param in the compute dtype), n elements, its weight decay (0
 * for norms). */
struct adamw_segment {
    float *master;     /* [n] fp32, or NULL when the master is held split (master_lo) */
    void *param;       /* [n] compute dtype (may be master in fp32; NULL: no compute copy) */
    const float *grad; /* [n] fp32 */
    void *m, *v;       /* [n] Adam moments, fp32 or bf16 (adamw_update_multi's mom_bytes) */
    size_t n;
    float weight_decay;
    /* [n] or NULL: the fp32 master held as two halves (train.master_weights: split): its bits
     * are (param's bf16 bits << 16) + master_lo as int16, and the update writes param as the
     * master rounded half away from zero in its bit pattern, which leaves the low half within
     * int16 (master_split.h): the same fp32 master as an fp32 array, 2 bytes a parameter less */
    uint16_t *master_lo;
};

/* One row set of a grouped expert weight gradient (expert_matmul_wgrad_sets): a micro-step's
 * expert rows, expert-major, as expert_matmul_backward takes them. */
#define MT_WGRAD_MAX_SETS 8
struct expert_rows {
    const void *dout;    /* [rows, O] output gradients */
    const void *in;      /* [rows, I] inputs */
    const int64_t *off;  /* backend memory [n_exp + 1]: each expert's rows */
    int64_t rows;        /* rows the two matrices hold (>= off[n_exp]) */
};

/* An exchange in flight as the device sees it (comm.h comm_exchange_arrival): it has arrived once
 * flags[d] - epoch >= 0, as int32, for every d < n but skip; flags NULL: not visible here. */
struct exchange_arrival {
    const uint32_t *flags; /* backend memory [n], written by the peers' copies */
    uint32_t epoch;
    int n, skip;
};

struct backend {
    const char *name;            /* "cpu" or "cuda" */
    size_t x_size;               /* bytes per compute-dtype element (4 or 2) */
    double peak_flops;           /* dense matmul peak in FLOP/s for MFU; 0 = unknown (CPU) */
    double mem_bytes;            /* device memory in bytes; 0 = not a device (CPU) */

    /* memory */
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);                 /* device to device */
    /* copy by a copy engine beside the backend's stream, after everything queued on it before the
     * call; copy_aside_join makes the stream wait for it. In between, queued work may read src
     * but neither write src nor touch dst (the SMs keep running kernels meanwhile). One at a
     * time; the CPU copies at once. */
    void (*copy_aside)(void *dst, const void *src, size_t bytes);
    void (*copy_aside_join)(void);
    void (*upload)(void *dst, const void *host_src, size_t bytes);          /* raw bytes */
    void (*download)(void *host_dst, const void *src, size_t bytes);        /* raw bytes, waits */
    void (*sync)(void);
    double (*device_used)(void);  /* bytes in use on the device by the whole process (the CUDA
                                   * context and libraries included); 0 on the CPU */

    /* casts between fp32 and the compute dtype */
    void (*cast_f32_to_x)(void *out, const float *in, size_t n);
    void (*cast_x_to_f32)(float *out, const void *in, size_t n);

    /* elementwise */
    void (*add_inplace)(void *y, const void *x, size_t n);                  /* y += x */
    void (*scale_f32)(float *x, size_t n, float s);                         /* x *= s */
    void (*add_f32)(float *y, const float *x, size_t n);                    /* y += x, fp32 */
    double (*sumsq_f32)(const float *x, size_t n);                          /* waits; fp64 sum */

    /* embedding: out[t] = wte[ids[t]]; backward scatter-adds into dwte */
    void (*embedding_forward)(void *out /*[T,H]*/, const int32_t *ids /*[T]*/,
                              const void *wte /*[V,H]*/, int T, int H);
    void (*embedding_backward)(float *dwte /*[V,H]*/, const void *dout /*[T,H]*/,
                               const int32_t *ids /*[T]*/, int T, int H);

    /* RMSNorm over the last dim C of N rows: out = w * (x * rstd), rstd = 1/sqrt(mean(x²) + eps) */
    void (*rmsnorm_forward)(void *out /*[N,C]*/, float *rstd /*[N]*/, const void *in /*[N,C]*/,
                            const void *w /*[C]*/, int N, int C, float eps);
    void (*rmsnorm_backward)(void *din /*[N,C]*/, float *dw /*[C]*/, const void *dout /*[N,C]*/,
                             const void *in /*[N,C]*/, const void *w /*[C]*/,
                             const float *rstd /*[N]*/, int N, int C, bool accumulate);

    /* y = x Wᵀ. Backward: din = dy W (NULL to skip), dw += dyᵀ x (NULL to skip). */
    void (*matmul_forward)(void *out /*[N,O]*/, const void *in /*[N,I]*/, const void *w /*[O,I]*/,
                           int N, int I, int O);
    /* out = resid + in Wᵀ, rounded to the compute dtype once (matmul_forward then add_inplace but
     * for the rounding in between; an fp32 backend gives exactly those two). out != resid. */
    void (*matmul_forward_residual)(void *out /*[N,O]*/, const void *in /*[N,I]*/,
                                    const void *w /*[O,I]*/, const void *resid /*[N,O]*/, int N,
                                    int I, int O);
    void (*matmul_backward)(void *din /*[N,I]*/, float *dw /*[O,I]*/, const void *dout /*[N,O]*/,
                            const void *in /*[N,I]*/, const void *w /*[O,I]*/, int N, int I, int O,
                            bool accumulate);
    /* Two projections of one input (attention's k and v), equal BIT FOR BIT to
     *   matmul_forward(out_a, in, w_a, N, I, O); matmul_forward(out_b, in, w_b, N, I, O)
     * and to
     *   matmul_backward(din, dw_a, dout_a, in, w_a, N, I, O, accumulate);
     *   matmul_backward(din, dw_b, dout_b, in, w_b, N, I, O, true)
     * (din, dw_a, dw_b: NULL to skip). CUDA runs each pair of GEMMs (forward; dw) as one batched
     * call with the very algorithm of the single GEMM (cuda/matmul.cuh: cuda_gemm_lt_pair); cuBLAS
     * documents no promise that this keeps the bits, so tests/unit/test_gpu_matmul2.c checks it. */
    void (*matmul2_forward)(void *out_a /*[N,O]*/, void *out_b /*[N,O]*/, const void *in /*[N,I]*/,
                            const void *w_a /*[O,I]*/, const void *w_b /*[O,I]*/, int N, int I,
                            int O);
    void (*matmul2_backward)(void *din /*[N,I]*/, float *dw_a /*[O,I]*/, float *dw_b /*[O,I]*/,
                             const void *dout_a /*[N,O]*/, const void *dout_b /*[N,O]*/,
                             const void *in /*[N,I]*/, const void *w_a /*[O,I]*/,
                             const void *w_b /*[O,I]*/, int N, int I, int O, bool accumulate);

    /* The router GEMM with fp32 logits (model.router_fp32): logits = x Wᵀ from compute-dtype
     * operands, accumulated and written in fp32; backward from fp32 dlogits with fp32 products:
     * din += (or =) dlogits W, rounded to the compute dtype once (with the existing din when
     * accumulating), dw += dlogitsᵀ x. In an fp32 backend these are matmul_forward/_backward. */
    void (*router_matmul_forward)(float *logits /*[N,O]*/, const void *in /*[N,I]*/,
                                  const void *w /*[O,I]*/, int N, int I, int O);
    void (*router_matmul_backward)(void *din /*[N,I]*/, float *dw /*[O,I]*/,
                                   const float *dlogits /*[N,O]*/, const void *in /*[N,I]*/,
                                   const void *w /*[O,I]*/, int N, int I, int O, bool accumulate);

    /* NeoX rotate-half RoPE on [T, nh, D] rows with positions pos[T]; inv_freq[i] = theta^(-2i/D)
     * in fp32. Out-of-place (out may equal in). */
    void (*rope_forward)(void *out, const void *in, const int32_t *pos /*[T]*/, int T, int nh, int D,
                         float theta);
    void (*rope_backward)(void *din, const void *dout, const int32_t *pos, int T, int nh, int D,
                          float theta);
    /* The per-head q_norm/k_norm and the RoPE after it, in one pass over the T·nh rows of D:
     * exactly rmsnorm_forward(out, rstd, in, w, T·nh, D, eps) then rope_forward(out, out, ...), the
     * normalised row rounded to the compute dtype in between. out may equal in. */
    void (*rmsnorm_rope_forward)(void *out /*[T,nh,D]*/, float *rstd /*[T·nh]*/,
                                 const void *in /*[T,nh,D]*/, const void *w /*[D]*/,
                                 const int32_t *pos /*[T]*/, int T, int nh, int D, float eps,
                                 float theta);
    /* Its backward: exactly rope_backward of dout (rounded to the compute dtype) fed to
     * rmsnorm_backward(din, dw, ·, in, w, rstd, T·nh, D, false): din overwritten, dw += the same
     * bits. din and dw are both required; din may equal dout (not in). */
    void (*rmsnorm_rope_backward)(void *din /*[T,nh,D]*/, float *dw /*[D]*/,
                                  const void *dout /*[T,nh,D]*/, const void *in /*[T,nh,D]*/,
                                  const void *w /*[D]*/, const float *rstd /*[T·nh]*/,
                                  const int32_t *pos /*[T]*/, int T, int nh, int D, float theta);

    /* Causal GQA attention, scale 1/sqrt(D); query head h uses kv head h / (Hq/Hkv).
     * q/out: [B,S,Hq,D], k/v: [B,S,Hkv,D], lse: [B,Hq,S] (log-sum-exp of the scaled scores).
     * seg: NULL, or a device [B,S] document id per token (data.document_masking): key j is visible
     * to query i of the same sequence iff j <= i and seg[j] == seg[i]. */
    void (*attention_forward)(void *out, float *lse, const void *q, const void *k, const void *v,
                              int B, int S, int Hq, int Hkv, int D, const int32_t *seg);
    /* work (work_bytes; may be null): memory free for the duration of the call that the backend
     * may use as scratch (the CUDA one keeps the dS tiles there when they fit, saving its own) */
    void (*attention_backward)(void *dq, void *dk, void *dv, const void *dout, const void *q,
                               const void *k, const void *v, const void *out, const float *lse,
                               int B, int S, int Hq, int Hkv, int D, const int32_t *seg,
                               void *work, size_t work_bytes);

    /* Router (docs/router.md): probs = softmax(logits) or sigmoid(logits) (o->sigmoid) in fp32;
     * choice score = probs + bias (bias NULL = none; it changes the selection only); with
     * o->n_group > 1 the experts form n_group equal groups, a group scores the sum of its two best
     * choice scores and only the best o->topk_group groups compete; top-k sorted by descending
     * score, ties to the lower id (o->force_balance: token t takes experts (t k + j) mod E
     * instead). topk_w = probs of the chosen experts, renormalised to sum 1 if o->norm_topk, then
     * × o->route_scale. */
    void (*router_forward)(int32_t *topk_idx /*[T,k]*/, float *topk_w /*[T,k]*/,
                           float *probs /*[T,E]*/, const float *logits /*[T,E]*/,
                           const float *bias /*[E] or NULL*/, int T, int E, int k,
                           const struct router_opts *o);
    /* dlogits = score backward (softmax or sigmoid) of (dp_route + aux_dp), where dp_route comes
     * from dtopk_w through route_scale, the renormalisation and the top-k scatter, and aux_dp[e]
     * (NULL = none) is added to every row's dp[e] (the aux loss gradient is the same for every
     * row of a pooled batch). */
    void (*router_backward)(float *dlogits /*[T,E]*/, const float *dtopk_w /*[T,k]*/,
                            const float *probs /*[T,E]*/, const int32_t *topk_idx /*[T,k]*/,
                            const float *aux_dp /*[E] or NULL*/, int T, int E, int k,
                            const struct router_opts *o);
    /* Aux-loss / load statistics: psum[e] += Σ_t probs[t,e]; count[e] += #(t, j) with idx = e. */
    /* The weights router_forward gives a selection made elsewhere (data.routing_replay):
     * topk_w[t, j] = probs[t, topk_idx[t, j]], renormalised to sum 1 if o->norm_topk, then
     * × o->route_scale; router_backward is its backward. */
    void (*router_gather_weights)(float *topk_w /*[T,k]*/, const float *probs /*[T,E]*/,
                                  const int32_t *topk_idx /*[T,k]*/, int T, int E, int k,
                                  const struct router_opts *o);
    void (*router_stats)(float *psum /*[E]*/, float *count /*[E]*/, const float *probs,
                         const int32_t *topk_idx, int T, int E, int k);
    /* The aux loss's gradient with respect to each expert's mean router probability, from a
     * micro-step's statistics (router_stats of every layer, zeros for dense ones): aux_dp[e] =
     * (float)(scale · E · Σ_l count_l[e] / rows²), the sum in fp64 in layer order, exactly as
     * train.c's aux_grad_from_counts does it on the host (so the bits are the same). */
    void (*aux_grad_from_stats)(float *aux_dp /*[E]*/, const float *stats /*[L, 2, E]*/, int L, int E,
                                double scale, double rows);

    /* MoE route plan (integers only: every backend gives the same answer). In place, each token's
     * k choices are sorted by ascending expert id, topk_w permuted alongside. Rows are then ordered
     * by (expert, token): src_row[row] = token, slot_row[t, j] = row of token t's j-th choice (-1
     * for an MT_NO_EXPERT slot, which gets no row), and off[e] (backend memory, E + 1 entries) =
     * expert e's first row, off[E] = the rows. Does not wait for the backend: the expert matmuls
     * read off where it is. Any other id outside [0, E) is a fatal error, raised by the time the
     * backend's next download or sync returns (before then it gets no row and slot -1). */
    void (*moe_route_plan)(int32_t *topk_idx /*[T,k]*/, float *topk_w /*[T,k]*/,
                           int32_t *src_row /*[<= T*k]*/, int32_t *slot_row /*[T,k]*/,
                           int64_t *off /*[E+1]*/, int T, int E, int k);
    /* Token-once dispatch plan over ep ranks of n_local experts (expert e on rank e / n_local).
     * In place, each token's choices are sorted by ascending expert id (weights alongside). A
     * "pair" (token, rank) stands for every rank a token uses; pairs are ordered by (rank, token):
     *   pair_tok[p] = its token; tok_pair[t, j] = the pair of (t, rank of choice j) at the first
     *   choice of each rank, -1 at the token's other choices of that rank;
     *   meta_idx[p, s] / meta_w[p, s] = the pair's s-th choice as a LOCAL expert id and its
     *   weight, ascending, then MT_NO_EXPERT / 0 up to k;
     *   w_map[t, j] = p·k + s, where choice j sits in its pair's slots;
     *   count_host[d] (HOST [ep]) = pairs for rank d, rows_host[d] (HOST [ep]) = the choices on
     *   rank d's experts (the expert rows its pairs make there, so that the receiver knows its
     *   row count without reading its route plan back); waits. An id outside [0, ep·n_local) is
     *   fatal.
     * block > 0 (>= T; the exchange without host waits, model.h rows_by_capacity): token t's pair
     * with rank d is pair d·block + t instead, and every other pair of the block is padding
     * (meta MT_NO_EXPERT / 0, pair_tok its own token, 0 past T), so that every block has a size
     * the host knows and its rows are the token rows themselves (the send is an all-gather, no
     * gather); the expert-side order is the packed plan's. count_host and rows_host may be NULL,
     * and then the call does not wait (a bad id is raised by the next download or sync, as
     * moe_route_plan's). */
    void (*moe_pair_plan)(int32_t *topk_idx /*[T,k]*/, float *topk_w /*[T,k]*/,
                          int32_t *pair_tok /*[<= T*min(k,ep), or ep*block]*/, int32_t *tok_pair /*[T,k]*/,
                          int32_t *meta_idx /*[P,k]*/, float *meta_w /*[P,k]*/,
                          int32_t *w_map /*[T,k]*/, int64_t *count_host /*[ep] or NULL*/,
                          int64_t *rows_host /*[ep] or NULL*/, int T, int ep, int n_local, int k, int block);
    /* The expert-side rows of a route plan held to a capacity (the exchange without host waits,
     * where the buffers are sized before the routing is known): need[0] = max(need[0],
     * off[n_exp]); if off[n_exp] > cap, need[1] += 1 and the plan is cut so that no kernel
     * leaves the buffers: off[e] = min(off[e], cap) and every slot_row >= cap becomes -1. The rows
     * past the used ones, src_row[min(off[n_exp], cap) .. cap), become -1 (gather_rows skips them). The
     * caller reads `need` with the step's metrics and runs the step again with room for need[0]
     * (a cut plan's results are never used). Does not wait. */
    void (*moe_rows_cap)(int64_t *off /*[n_exp+1]*/, int32_t *src_row /*[>= cap]*/, int32_t *slot_row /*[n_slots]*/,
                         int64_t *need /*[2]*/, int n_slots, int n_exp, int64_t cap);
    /* Where each expert's rows from the pairs [src_lo, src_hi) begin and end: lo[e] = the first row
     * r of [off[e], off[e+1]) with src_row[r] >= src_lo (off[e+1] if none), hi[e] = the first with
     * src_row[r] >= src_hi. A route plan's rows are in ascending src_row within each expert, so
     * the rows of one source rank's pairs (a block of the received pairs) are [lo[e], hi[e]) and
     * the others' lie before and after it; lo[n_exp] = hi[n_exp] = off[n_exp], so that lo and hi
     * are row offsets too (expert_matmul_forward's off, with end). Does not wait. */
    void (*moe_rows_split)(int64_t *lo /*[n_exp+1]*/, int64_t *hi /*[n_exp+1]*/, const int64_t *off /*[n_exp+1]*/,
                           const int32_t *src_row, int n_exp, int64_t src_lo, int64_t src_hi);
    /* out[i] = in[idx[i]] for i < n, fp32 values (index bookkeeping of routing weights) */
    void (*gather_f32)(float *out, const float *in, const int32_t *idx, int n);

    /* Row gather: out[r] = in[idx[r]] for r < R; a row whose idx is negative is left as it is (the
     * rows past a capacity plan's used ones, moe_rows_cap). Backward: din[idx[r]] += dout[r] (din
     * must be zeroed or hold a value to add to; rows are added in ascending r). */
    void (*gather_rows)(void *out /*[R,H]*/, const void *in /*[*,H]*/, const int32_t *idx /*[R]*/,
                        int R, int H);
    void (*gather_rows_backward)(void *din /*[*,H]*/, const void *dout /*[R,H]*/,
                                 const int32_t *idx /*[R]*/, int R, int H);
    /* gather_rows for part of the rows: those whose idx lies in [lo, hi) (inside; read at
     * in[idx[r] - lo]) or those whose idx lies outside it (read at in[idx[r]]); every other row of
     * out, and every row with a negative idx, is left as it is. The fixed exchange's dispatch: a
     * rank's own token rows from its own memory while the other ranks' cross, then theirs. */
    void (*gather_rows_part)(void *out /*[R,H]*/, const void *in /*[*,H]*/, const int32_t *idx /*[R]*/,
                             int R, int H, int lo, int hi, bool inside);

    /* The dispatch's copy by slot: out[slot[i,j]] = in[i] for i < n, j < k, wherever slot[i,j] >= 0
     * (a negative slot is empty); a row of out that no slot names is left as it is. With a route
     * plan's exp_slot it writes what gather_rows with its exp_src writes, the same bytes, but reads
     * each source row once instead of once per slot, and not at all when it has no slot (ops at
     * the bench shape: docs/benchmarks.md, forty-fifth session). */
    void (*dispatch_rows)(void *out /*[R,H]*/, const void *in /*[n,H]*/, const int32_t *slot /*[n,k]*/,
                          int n, int k, int H);

    /* MoE combine: out[t] = Σ_j w[t,j] · y[slot_row[t,j]] over j = 0..k-1 in that order (the caller
     * orders each token's slots by ascending expert id). With resid (else NULL), out[t] = that sum
     * rounded to the compute dtype, plus resid[t]: exactly the sum followed by add_inplace, in one
     * pass (the decoder layer's residual). Backward: dy[slot_row[t,j]] = w[t,j]·dout[t],
     * dw[t,j] = <dout[t], y[slot_row[t,j]]> (overwritten). A slot row < 0 is empty: it adds
     * nothing, and the backward writes neither dy nor dw for it. */
    void (*moe_combine_forward)(void *out /*[T,H]*/, const void *y /*[R,H]*/,
                                const int32_t *slot_row /*[T,k]*/, const float *w /*[T,k]*/,
                                const void *resid /*[T,H] or NULL*/, int T, int k, int H);
    void (*moe_combine_backward)(void *dy /*[R,H]*/, float *dw /*[T,k]*/, const void *dout /*[T,H]*/,
                                 const void *y /*[R,H]*/, const int32_t *slot_row, const float *w,
                                 int T, int k, int H);

    /* Grouped expert matmul: rows [off[e], off[e+1]) of `in` go through expert e's W[e] ([O,I]).
     * off is backend memory (n_exp + 1 entries, non-decreasing, from 0; moe_route_plan's), so the
     * host need not wait for the routing; R is how many rows `in` and `out` hold (>= off[n_exp]:
     * rows past off[n_exp] are neither written nor used). Backward: din (NULL to skip) overwritten;
     * dw[e] += dyᵀ x over that expert's rows (experts with no rows get nothing added), or with
     * dw_overwrite dw[e] = dyᵀ x and experts with no rows get zeros: for a dw whose zeroing the
     * caller skipped (model.h: exp_dw_fresh), which saves the memset and the first read.
     * Forward only: end (backend memory [n_exp], or NULL) makes expert e's rows [off[e], end[e])
     * (off[e] <= end[e] <= off[e+1]): part of each expert's rows, the other rows of out left as
     * they are (moe_dispatch.c: the rows of the other ranks' tokens first, moe_rows_split). */
    void (*expert_matmul_forward)(void *out /*[R,O]*/, const void *in /*[R,I]*/,
                                  const void *w /*[n_exp,O,I]*/, const int64_t *off,
                                  const int64_t *end /*[n_exp] or NULL*/, int64_t R, int n_exp, int I, int O);
    void (*expert_matmul_backward)(void *din /*[R,I]*/, float *dw /*[n_exp,O,I]*/,
                                   const void *dout /*[R,O]*/, const void *in /*[R,I]*/,
                                   const void *w /*[n_exp,O,I]*/, const int64_t *off, int64_t R,
                                   int n_exp, int I, int O, bool dw_overwrite);
    /* The weight-gradient half of expert_matmul_backward over n_sets row sets (several
     * micro-steps' rows, model.h: expert wgrad groups; 1 .. MT_WGRAD_MAX_SETS): dw[e] += Σ_s
     * dy_sᵀ x_s over expert e's rows of each set (each set's off and rows as off and R above);
     * dw_overwrite as above. One pass over dw for all sets, where the backward would make one a
     * set. dw_sumsq (backend memory [1], or NULL): receives Σ dw² over the whole of dw after the
     * update, in double in an order that depends on the shapes alone: the gradient norm's share
     * of dw where this is its last update of the step. Overwriting, the CUDA kernel sums each tile
     * from the accumulators it stores, so no pass over dw from memory follows; adding, it takes
     * such a pass after the call. */
    void (*expert_matmul_wgrad_sets)(float *dw /*[n_exp,O,I]*/, const struct expert_rows *sets,
                                     int n_sets, int n_exp, int I, int O, bool dw_overwrite,
                                     double *dw_sumsq);
    /* The same in parts, to fill an exchange's wait (moe_wgrad_jobs.c): each call takes the work
     * `cursor` (backend memory, 2 int32, zeroed before the first part; the same arguments in every
     * part) has not passed; until NULL: all of it, else what runs while that exchange is in flight
     * (the CUDA kernel stops taking tiles once its flags show the rows arrived; the CPU backend
     * takes MT_CPU_WGRAD_PART_EXPERTS experts a part, default 0, for tests). Each piece adds its
     * sum to dw once, so the parts make the bits of one expert_matmul_wgrad_sets. */
    void (*expert_matmul_wgrad_part)(float *dw /*[n_exp,O,I]*/, const struct expert_rows *sets,
                                     int n_sets, int n_exp, int I, int O, bool dw_overwrite,
                                     int32_t *cursor, const struct exchange_arrival *until);

    /* SwiGLU on fused [gate | up] rows: out = silu(g) * u. rows (backend memory, or NULL): only
     * the first min(R, *rows) rows, the others left as they are (a route plan's off[n_exp] where
     * the buffers hold a capacity of R rows: the fixed MoE exchange). */
    void (*swiglu_forward)(void *out /*[R,I]*/, const void *gu /*[R,2I]*/, int R, int I,
                           const int64_t *rows);
    void (*swiglu_backward)(void *dgu /*[R,2I]*/, const void *dout /*[R,I]*/, const void *gu,
                            int R, int I, const int64_t *rows);

    /* Cross-entropy on fp32-upcast logits. targets[t] == MT_IGNORE_INDEX gives loss 0 and grad 0.
     * forward: lse[t] = logsumexp(z[t]) (0 for ignored rows), losses[t] = lse[t] - z[t, target].
     * backward, given the forward's lse: dlogits = scale·(exp(z - lse) - onehot), one pass over the
     * logits (dlogits may alias logits). */
    void (*cross_entropy_forward)(float *losses /*[N]*/, float *lse /*[N]*/,
                                  const void *logits /*[N,V]*/, const int32_t *targets /*[N]*/,
                                  int N, int V);
    void (*cross_entropy_backward)(void *dlogits /*[N,V]*/, const void *logits /*[N,V]*/,
                                   const float *lse /*[N]*/, const int32_t *targets /*[N]*/, int N,
                                   int V, float scale);

    /* cross_entropy_forward, then cross_entropy_backward with the logits' memory as dlogits: the
     * losses, lse and the gradient of a training step at once (CUDA on Hopper: one read and one
     * write of the logits; otherwise the two ops). */
    void (*cross_entropy_fused)(float *losses /*[N]*/, float *lse /*[N]*/,
                                void *logits /*[N,V] in: logits, out: dlogits*/,
                                const int32_t *targets /*[N]*/, int N, int V, float scale);

    /* AdamW with bias correction (step t >= 1) and decoupled weight decay; grad is multiplied by
     * grad_scale first (clipping). Updates master, m, v; writes the compute copy param (may be the
     * same memory as master on the CPU; NULL = no compute copy to write). */
    void (*adamw_update)(float *master, void *param, const float *grad, float *m, float *v,
                         size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, int t, float grad_scale);
    /* The same with bf16 moments (train.optimizer_state_dtype: bf16, Megatron-Core's precision-aware
     * optimizer): m and v are read as bf16, updated in fp32 and rounded to nearest-even bf16. */
    void (*adamw_update_m16)(float *master, void *param, const float *grad, void *m, void *v,
                             size_t n, float lr, float beta1, float beta2, float eps,
                             float weight_decay, int t, float grad_scale);
    /* adamw_update (mom_bytes 4: fp32 moments) or adamw_update_m16 (mom_bytes 2) over n_seg
     * segments (each its own arrays, length and weight decay) in one pass: on the GPU one launch
     * for the whole optimizer step instead of one per segment. Each segment's results are
     * bit-identical to the per-segment op on it; segments must not overlap. Segments with
     * master_lo (all or none of them; a bf16 param) take and leave their master split, its fp32
     * values the same bits as an fp32 master's. */
    void (*adamw_update_multi)(const struct adamw_segment *segs, int n_seg, size_t mom_bytes,
                               float lr, float beta1, float beta2, float eps, int t,
                               float grad_scale);
};

/* The fp32 CPU reference backend (always available). */
const struct backend *backend_cpu(void);
/* The CUDA backend (bf16 compute, or fp32 when fp32 is true: model.precision), or NULL when not
 * compiled in or no device is present. Selects the device local_rank % device count. */
const struct backend *backend_cuda(bool fp32, int local_rank);

#endif
