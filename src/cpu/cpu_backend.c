/* The CPU backend table: thin adapters from the void * compute-dtype interface of ops.h to the
 * float * functions of cpu_ops.h (the compute dtype is fp32 here, so x_size is 4). */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cpu/cpu_ops.h"
#include "ops.h"

static void b_nothing(void) {}
static void b_upload(void *dst, const void *src, size_t bytes) { cpu_copy(dst, src, bytes); }
static void b_download(void *dst, const void *src, size_t bytes) { cpu_copy(dst, src, bytes); }
static void b_cast_f32_to_x(void *out, const float *in, size_t n) { cpu_cast_f32(out, in, n); }
static void b_cast_x_to_f32(float *out, const void *in, size_t n) { cpu_cast_f32(out, in, n); }
static void b_add_inplace(void *y, const void *x, size_t n) { cpu_add_inplace(y, x, n); }

static void b_embedding_forward(void *out, const int32_t *ids, const void *wte, int T, int H)
{
    cpu_embedding_forward(out, ids, wte, T, H);
}
static void b_embedding_backward(float *dwte, const void *dout, const int32_t *ids, int T, int H)
{
    cpu_embedding_backward(dwte, dout, ids, T, H);
}

static void b_rmsnorm_forward(void *out, float *rstd, const void *in, const void *w, int N, int C,
                              float eps)
{
    cpu_rmsnorm_forward(out, rstd, in, w, N, C, eps);
}
static void b_rmsnorm_backward(void *din, float *dw, const void *dout, const void *in,
                               const void *w, const float *rstd, int N, int C, bool accumulate)
{
    cpu_rmsnorm_backward(din, dw, dout, in, w, rstd, N, C, accumulate);
}

static void b_matmul_forward(void *out, const void *in, const void *w, int N, int I, int O)
{
    cpu_matmul_forward(out, in, w, N, I, O);
}
static void b_matmul_forward_residual(void *out, const void *in, const void *w, const void *resid,
                                      int N, int I, int O)
{
    MT_CHECK(out != resid, "matmul_forward_residual: out and resid are the same buffer");
    cpu_matmul_forward(out, in, w, N, I, O);
    cpu_add_inplace(out, resid, (size_t)N * O);
}
static void b_matmul_backward(void *din, float *dw, const void *dout, const void *in,
                              const void *w, int N, int I, int O, bool accumulate)
{
    cpu_matmul_backward(din, dw, dout, in, w, N, I, O, accumulate);
}

static void b_matmul2_forward(void *out_a, void *out_b, const void *in, const void *w_a,
                              const void *w_b, int N, int I, int O)
{
    cpu_matmul_forward(out_a, in, w_a, N, I, O);
    cpu_matmul_forward(out_b, in, w_b, N, I, O);
}
static void b_matmul2_backward(void *din, float *dw_a, float *dw_b, const void *dout_a,
                               const void *dout_b, const void *in, const void *w_a, const void *w_b,
                               int N, int I, int O, bool accumulate)
{
    cpu_matmul_backward(din, dw_a, dout_a, in, w_a, N, I, O, accumulate);
    cpu_matmul_backward(din, dw_b, dout_b, in, w_b, N, I, O, true);
}

/* fp32 compute: the router GEMM is the plain one */
static void b_router_matmul_forward(float *logits, const void *in, const void *w, int N, int I, int O)
{
    cpu_matmul_forward(logits, in, w, N, I, O);
}
static void b_router_matmul_backward(void *din, float *dw, const float *dlogits, const void *in,
                                     const void *w, int N, int I, int O, bool accumulate)
{
    cpu_matmul_backward(din, dw, dlogits, in, w, N, I, O, accumulate);
}

static void b_rope_forward(void *out, const void *in, const int32_t *pos, int T, int nh, int D,
                           float theta)
{
    cpu_rope_forward(out, in, pos, T, nh, D, theta);
}
static void b_rope_backward(void *din, const void *dout, const int32_t *pos, int T, int nh, int D,
                            float theta)
{
    cpu_rope_backward(din, dout, pos, T, nh, D, theta);
}

/* the two ops in turn (fp32 compute: nothing to round in between) */
static void b_rmsnorm_rope_forward(void *out, float *rstd, const void *in, const void *w,
                                   const int32_t *pos, int T, int nh, int D, float eps, float theta)
{
    cpu_rmsnorm_forward(out, rstd, in, w, T * nh, D, eps);
    cpu_rope_forward(out, out, pos, T, nh, D, theta);
}
static void b_rmsnorm_rope_backward(void *din, float *dw, const void *dout, const void *in,
                                    const void *w, const float *rstd, const int32_t *pos, int T,
                                    int nh, int D, float theta)
{
    cpu_rope_backward(din, dout, pos, T, nh, D, theta);
    cpu_rmsnorm_backward(din, dw, din, in, w, rstd, T * nh, D, false);
}

static void b_attention_forward(void *out, float *lse, const void *q, const void *k, const void *v,
                                int B, int S, int Hq, int Hkv, int D, const int32_t *seg)
{
    cpu_attention_forward(out, lse, q, k, v, B, S, Hq, Hkv, D, seg);
}
static void b_attention_backward(void *dq, void *dk, void *dv, const void *dout, const void *q,
                                 const void *k, const void *v, const void *out, const float *lse,
                                 int B, int S, int Hq, int Hkv, int D, const int32_t *seg,
                                 void *work, size_t work_bytes)
{
    (void)work, (void)work_bytes;
    cpu_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D, seg);
}

static void b_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                             const float *bias, int T, int E, int k, const struct router_opts *o)
{
    cpu_router_forward(topk_idx, topk_w, probs, logits, bias, T, E, k, o);
}
static void b_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                              const int32_t *topk_idx, const float *aux_dp, int T, int E, int k,
                              const struct router_opts *o)
{
    cpu_router_backward(dlogits, dtopk_w, probs, topk_idx, aux_dp, T, E, k, o);
}

static void b_gather_rows(void *out, const void *in, const int32_t *idx, int R, int H)
{
    cpu_gather_rows(out, in, idx, R, H);
}
static void b_gather_rows_part(void *out, const void *in, const int32_t *idx, int R, int H, int lo, int hi,
                               bool inside)
{
    cpu_gather_rows_part(out, in, idx, R, H, lo, hi, inside);
}
static void b_dispatch_rows(void *out, const void *in, const int32_t *slot, int n, int k, int H)
{
    cpu_dispatch_rows(out, in, slot, n, k, H);
}
static void b_gather_rows_backward(void *din, const void *dout, const int32_t *idx, int R, int H)
{
    cpu_gather_rows_backward(din, dout, idx, R, H);
}

static void b_moe_combine_forward(void *out, const void *y, const int32_t *slot_row,
                                  const float *w, const void *resid, int T, int k, int H)
{
    cpu_moe_combine_forward(out, y, slot_row, w, T, k, H);
    if (resid) cpu_add_inplace(out, resid, (size_t)T * H);
}
static void b_moe_combine_backward(void *dy, float *dw, const void *dout, const void *y,
                                   const int32_t *slot_row, const float *w, int T, int k, int H)
{
    cpu_moe_combine_backward(dy, dw, dout, y, slot_row, w, T, k, H);
}

/* off (backend memory here is host memory) must fit the R rows the caller holds */
static void check_rows(const char *what, const int64_t *off, int64_t R, int n_exp)
{
    MT_CHECK(n_exp <= 0 || off[n_exp] <= R, "%s: the offsets end at row %lld of %lld", what,
             (long long)off[n_exp], (long long)R);
}

static void b_expert_matmul_forward(void *out, const void *in, const void *w, const int64_t *off,
                                    const int64_t *end, int64_t R, int n_exp, int I, int O)
{
    check_rows("expert_matmul", off, R, n_exp);
    cpu_expert_matmul_forward(out, in, w, off, end, n_exp, I, O);
}
static void b_expert_matmul_backward(void *din, float *dw, const void *dout, const void *in,
                                     const void *w, const int64_t *off, int64_t R, int n_exp, int I,
                                     int O, bool dw_overwrite)
{
    check_rows("expert_matmul backward", off, R, n_exp);
    /* the same sums as zeroed dw += them (no time to save on the reference backend) */
    if (dw && dw_overwrite) memset(dw, 0, (size_t)n_exp * O * I * sizeof(float));
    cpu_expert_matmul_backward(din, dw, dout, in, w, off, n_exp, I, O);
}

static void b_expert_matmul_wgrad_sets(float *dw, const struct expert_rows *sets, int n_sets,
                                       int n_exp, int I, int O, bool dw_overwrite, double *dw_sumsq)
{
    MT_CHECK(n_sets >= 1 && n_sets <= MT_WGRAD_MAX_SETS, "expert_matmul_wgrad_sets: %d row sets", n_sets);
    for (int s = 0; s < n_sets; s++) check_rows("expert_matmul_wgrad_sets", sets[s].off, sets[s].rows, n_exp);
    if (dw_overwrite) memset(dw, 0, (size_t)n_exp * O * I * sizeof(float));
    for (int s = 0; s < n_sets; s++)
        cpu_expert_matmul_backward(NULL, dw, sets[s].dout, sets[s].in, NULL, sets[s].off, n_exp, I, O);
    if (dw_sumsq) {
        double ss = 0;
        for (size_t i = 0; i < (size_t)n_exp * O * I; i++) ss += (double)dw[i] * dw[i];
        *dw_sumsq = ss;
    }
}

/* experts a part takes where until is set: MT_CPU_WGRAD_PART_EXPERTS (default 0), so that tests
 * can make the parts split a job anywhere */
static int part_experts(void)
{
    const char *env = getenv("MT_CPU_WGRAD_PART_EXPERTS");
    return env ? atoi(env) : 0;
}

/* cursor[0]: the experts done; each expert's sums as b_expert_matmul_wgrad_sets makes them */
static void b_expert_matmul_wgrad_part(float *dw, const struct expert_rows *sets, int n_sets, int n_exp,
                                       int I, int O, bool dw_overwrite, int32_t *cursor,
                                       const struct exchange_arrival *until)
{
    MT_CHECK(n_sets >= 1 && n_sets <= MT_WGRAD_MAX_SETS, "expert_matmul_wgrad_part: %d row sets", n_sets);
    for (int s = 0; s < n_sets; s++) check_rows("expert_matmul_wgrad_part", sets[s].off, sets[s].rows, n_exp);
    const int e0 = MT_MIN(MT_MAX(cursor[0], 0), n_exp);
    const int e1 = until ? MT_MIN(n_exp, e0 + MT_MAX(part_experts(), 0)) : n_exp;
    if (e1 <= e0) return;
    const size_t per = (size_t)O * I;
    if (dw_overwrite) memset(dw + e0 * per, 0, (size_t)(e1 - e0) * per * sizeof(float));
    for (int s = 0; s < n_sets; s++)
        cpu_expert_matmul_backward(NULL, dw + e0 * per, sets[s].dout, sets[s].in, NULL, sets[s].off + e0,
                                   e1 - e0, I, O);
    cursor[0] = e1;
}

static void b_swiglu_forward(void *out, const void *gu, int R, int I, const int64_t *rows)
{
    cpu_swiglu_forward(out, gu, rows && *rows < R ? (int)*rows : R, I);
}
static void b_swiglu_backward(void *dgu, const void *dout, const void *gu, int R, int I, const int64_t *rows)
{
    cpu_swiglu_backward(dgu, dout, gu, rows && *rows < R ? (int)*rows : R, I);
}

static void b_cross_entropy_forward(float *losses, float *lse, const void *logits,
                                    const int32_t *targets, int N, int V)
{
    cpu_cross_entropy_forward(losses, lse, logits, targets, N, V);
}
static void b_cross_entropy_backward(void *dlogits, const void *logits, const float *lse,
                                     const int32_t *targets, int N, int V, float scale)
{
    cpu_cross_entropy_backward(dlogits, logits, lse, targets, N, V, scale);
}
static void b_cross_entropy_fused(float *losses, float *lse, void *logits, const int32_t *targets,
                                  int N, int V, float scale)
{
    cpu_cross_entropy_forward(losses, lse, logits, targets, N, V);
    cpu_cross_entropy_backward(logits, logits, lse, targets, N, V, scale);
}

static void b_adamw_update_m16(float *master, void *param, const float *grad, void *m, void *v,
                               size_t n, float lr, float beta1, float beta2, float eps,
                               float weight_decay, int t, float grad_scale)
{
    cpu_adamw_update_m16(master, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t, grad_scale);
}

static void b_adamw_update(float *master, void *param, const float *grad, float *m, float *v,
                           size_t n, float lr, float beta1, float beta2, float eps,
                           float weight_decay, int t, float grad_scale)
{
    cpu_adamw_update(master, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t,
                     grad_scale);
}

static const struct backend cpu_backend = {
    .name = "cpu",
    .x_size = sizeof(float),
    .alloc = cpu_alloc,
    .device_used = cpu_device_used,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .copy_aside = cpu_copy,
    .copy_aside_join = b_nothing,
    .upload = b_upload,
    .download = b_download,
    .sync = cpu_sync,
    .cast_f32_to_x = b_cast_f32_to_x,
    .cast_x_to_f32 = b_cast_x_to_f32,
    .add_inplace = b_add_inplace,
    .scale_f32 = cpu_scale_f32,
    .add_f32 = cpu_add_inplace,
    .sumsq_f32 = cpu_sumsq_f32,
    .embedding_forward = b_embedding_forward,
    .embedding_backward = b_embedding_backward,
    .rmsnorm_forward = b_rmsnorm_forward,
    .rmsnorm_backward = b_rmsnorm_backward,
    .matmul_forward = b_matmul_forward,
    .matmul_forward_residual = b_matmul_forward_residual,
    .matmul_backward = b_matmul_backward,
    .matmul2_forward = b_matmul2_forward,
    .matmul2_backward = b_matmul2_backward,
    .router_matmul_forward = b_router_matmul_forward,
    .router_matmul_backward = b_router_matmul_backward,
    .rope_forward = b_rope_forward,
    .rope_backward = b_rope_backward,
    .rmsnorm_rope_forward = b_rmsnorm_rope_forward,
    .rmsnorm_rope_backward = b_rmsnorm_rope_backward,
    .attention_forward = b_attention_forward,
    .attention_backward = b_attention_backward,
    .router_forward = b_router_forward,
    .router_backward = b_router_backward,
    .router_gather_weights = cpu_router_gather_weights,
    .router_stats = cpu_router_stats,
    .aux_grad_from_stats = cpu_aux_grad_from_stats,
    .moe_route_plan = cpu_moe_route_plan,
    .moe_pair_plan = cpu_moe_pair_plan,
    .moe_rows_cap = cpu_moe_rows_cap,
    .moe_rows_split = cpu_moe_rows_split,
    .gather_f32 = cpu_gather_f32,
    .gather_rows = b_gather_rows,
    .gather_rows_part = b_gather_rows_part,
    .gather_rows_backward = b_gather_rows_backward,
    .dispatch_rows = b_dispatch_rows,
    .moe_combine_forward = b_moe_combine_forward,
    .moe_combine_backward = b_moe_combine_backward,
    .expert_matmul_forward = b_expert_matmul_forward,
    .expert_matmul_backward = b_expert_matmul_backward,
    .expert_matmul_wgrad_sets = b_expert_matmul_wgrad_sets,
    .expert_matmul_wgrad_part = b_expert_matmul_wgrad_part,
    .swiglu_forward = b_swiglu_forward,
    .swiglu_backward = b_swiglu_backward,
    .cross_entropy_forward = b_cross_entropy_forward,
    .cross_entropy_backward = b_cross_entropy_backward,
    .cross_entropy_fused = b_cross_entropy_fused,
    .adamw_update = b_adamw_update,
    .adamw_update_m16 = b_adamw_update_m16,
    .adamw_update_multi = cpu_adamw_update_multi,
};

const struct backend *backend_cpu(void) { return &cpu_backend; }

#ifndef MT_HAVE_CUDA
/* Built without nvcc: there is no CUDA backend (cuda/backend_cuda.cu defines it otherwise). */
const struct backend *backend_cuda(bool fp32, int local_rank)
{
    (void)fp32;
    (void)local_rank;
    return NULL;
}
#endif
