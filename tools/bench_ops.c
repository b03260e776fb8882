/* Micro-benchmark of the memory-bound ops of the CUDA backend, called through the backend table
 * (backend_cuda) at the shapes of one Qwen3-30B-A3B micro-step: T = 8192 tokens, H = 2048, top-8 of
 * 128 experts (R = 65536 expert rows), expert width I = 768, 32 query / 4 key-value heads of 128.
 *
 *   bench_ops [reps [fp32|bf16 [name part]]]   (default 20 timed samples, bf16, every op;
 *                                               a name part times only the ops it names)
 *
 * Each sample times a batch of BATCH back-to-back calls between two syncs of the backend's stream
 * (host wall clock), so launch gaps are hidden as in a training step; the table gives the median
 * sample divided by BATCH, after two warm-up batches. GB/s counts the bytes each call must read and
 * write once (inputs read, outputs written, accumulated outputs read and written; index arrays and
 * weights of a few KB left out) over that time. Inputs are random normal values (a 1 Mi-element
 * random block repeated), the route is a random top-8 of 128 per token in the layout of the route
 * plan (rows by expert then token). AdamW runs over one layer's tensors, per tensor and as one
 * multi-segment call, with fp32 moments (7 fp32 arrays read or written plus the compute copy per
 * parameter) and with bf16 moments (3 fp32 and 4 bf16 plus the copy). Also timed: the router's
 * fp32-product matmuls (GEMMs, not bandwidth-bound: GB/s there only for scale) and the combine
 * with the layer's residual against the combine followed by add_inplace, the loss at the LM head's
 * shape, and the gradient norm's sum of squares (its result download and sync included). Without
 * CUDA (or a GPU) it says so and exits 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "common.h"
#include "ops.h"

enum { BATCH = 10, WARM_BATCHES = 2, RAND_BLOCK = 1 << 20 };

static const struct backend *be;
static float *rand_f32; /* device, RAND_BLOCK fp32 normals */

/* a compute-dtype device tensor of n elements filled from the random block */
static void *x_random(size_t n)
{
    char *d = be->alloc(n * be->x_size);
    for (size_t off = 0; off < n; off += RAND_BLOCK) {
        const size_t len = n - off < RAND_BLOCK ? n - off : RAND_BLOCK;
        be->cast_f32_to_x(d + off * be->x_size, rand_f32, len);
    }
    return d;
}

static float *f32_random(size_t n)
{
    float *d = be->alloc(n * sizeof(float));
    for (size_t off = 0; off < n; off += RAND_BLOCK) {
        const size_t len = n - off < RAND_BLOCK ? n - off : RAND_BLOCK;
        be->copy(d + off, rand_f32, len * sizeof(float));
    }
    return d;
}

/* ---------------------------------------------------------------- the shapes and buffers */
enum { T = 8192, H = 2048, E = 128, K = 8, R = T * K, I = 768, HQ = 32, HKV = 4, D = 128 };
/* the loss at the LM head's shape: logits [T, V] (the backward's dlogits replace them, which
 * keeps them finite call after call), targets [T], losses and lse [T] */
enum { V = 151936 };
static void *ce_z;
static int32_t *ce_tgt;
static float *ce_loss, *ce_lse;

static void *x_th, *x_th2, *x_th3;           /* [T, H] */
static void *x_rh, *x_rh2;                   /* [R, H] */
static void *x_gu, *x_gu2, *x_act;           /* [R, 2I], [R, 2I], [R, I] */
static void *x_q, *x_q2, *x_q3, *x_k, *x_k2, *x_k3; /* q [T, HQ, D], k [T, HKV, D] */
static void *x_wh, *x_wd;                    /* norm weights [H], [D] */
static float *rstd_t, *rstd_q, *rstd_k, *dw_h, *dw_d, *cw, *dcw;
static void *x_we;                           /* router weight [E, H] */
static float *f_logits, *f_dw_router;        /* [T, E] logits / their gradient, dw [E, H] */
static int32_t *src_row, *slot_row, *pos;

/* the route plan's layout for a random top-K of E per token: rows by (expert, token);
 * src_row[row] = token, slot_row[t, j] = row of the token's j-th choice (ascending expert) */
static void make_route(void)
{
    int32_t *choice = mt_malloc((size_t)T * K * sizeof *choice);
    int64_t count[E + 1];
    memset(count, 0, sizeof count);
    uint64_t x = 0x2545f4914f6cdd1dull;
    for (int t = 0; t < T; t++) {
        unsigned char used[E];
        memset(used, 0, sizeof used);
        for (int j = 0; j < K; j++) {
            int e;
            do {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                e = (int)(x % E);
            } while (used[e]);
            used[e] = 1;
        }
        int j = 0;
        for (int e = 0; e < E; e++)
            if (used[e]) choice[(size_t)t * K + j++] = e, count[e + 1]++;
    }
    for (int e = 0; e < E; e++) count[e + 1] += count[e];
    int32_t *src = mt_malloc((size_t)R * sizeof *src), *slot = mt_malloc((size_t)R * sizeof *slot);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++) {
            const int64_t row = count[choice[(size_t)t * K + j]]++;
            src[row] = t;
            slot[(size_t)t * K + j] = (int32_t)row;
        }
    src_row = be->alloc((size_t)R * sizeof(int32_t));
    slot_row = be->alloc((size_t)R * sizeof(int32_t));
    be->upload(src_row, src, (size_t)R * sizeof(int32_t));
    be->upload(slot_row, slot, (size_t)R * sizeof(int32_t));
    int32_t *p = mt_malloc((size_t)T * sizeof *p);
    for (int t = 0; t < T; t++) p[t] = t % 4096; /* two sequences of 4096 */
    pos = be->alloc((size_t)T * sizeof(int32_t));
    be->upload(pos, p, (size_t)T * sizeof(int32_t));
    free(choice), free(src), free(slot), free(p);
}

/* ---------------------------------------------------------------- the ops */
enum {
    OP_RMS_FWD_H, OP_RMS_FWD_Q, OP_RMS_FWD_K, OP_RMS_BWD_H, OP_RMS_BWD_Q, OP_RMS_BWD_K,
    OP_SWIGLU_FWD, OP_SWIGLU_BWD, OP_GATHER, OP_GATHER_BWD, OP_DISPATCH, OP_COMBINE_FWD, OP_COMBINE_BWD,
    OP_ROPE_FWD_Q, OP_ROPE_BWD_Q, OP_ROPE_FWD_K, OP_RMS_ROPE_FWD_Q, OP_RMS_ROPE_BWD_Q,
    OP_RMS_ROPE_FWD_K, OP_RMS_ROPE_BWD_K, OP_ADD, OP_CAST, OP_ADAMW_SEG, OP_ADAMW_MULTI,
    OP_ADAMW16_SEG, OP_ADAMW16_MULTI, OP_ROUTER_MM_FWD, OP_ROUTER_MM_BWD, OP_ROUTER_MM_BWD_DIN,
    OP_ROUTER_MM_BWD_DW, OP_COMBINE_THEN_ADD, OP_COMBINE_RESID, OP_RMS_BWD_H_ACC,
    OP_CE_FWD, OP_CE_BWD, OP_CE_TWO, OP_CE_FUSED, OP_SUMSQ,
    OP_COUNT
};

static const char *op_name[OP_COUNT] = {
    "rmsnorm_forward C=2048 N=8192", "rmsnorm_forward C=128 N=262144 (q)",
    "rmsnorm_forward C=128 N=32768 (k)", "rmsnorm_backward C=2048 N=8192 +dw",
    "rmsnorm_backward C=128 N=262144 +dw", "rmsnorm_backward C=128 N=32768 +dw",
    "swiglu_forward R=65536 I=768", "swiglu_backward R=65536 I=768",
    "gather_rows R=65536 H=2048", "gather_rows_backward R=65536 H=2048",
    "dispatch_rows T=8192 k=8 H=2048 (the gather_rows rows, by slot)",
    "moe_combine_forward T=8192 k=8 H=2048", "moe_combine_backward T=8192 k=8 H=2048",
    "rope_forward q T=8192 32x128 (in place)", "rope_backward q T=8192 32x128",
    "rope_forward k T=8192 4x128", "rmsnorm_rope_forward q T=8192 32x128",
    "rmsnorm_rope_backward q T=8192 32x128 +dw", "rmsnorm_rope_forward k T=8192 4x128",
    "rmsnorm_rope_backward k T=8192 4x128 +dw", "add_inplace n=16.7M", "cast_x_to_f32 n=16.7M",
    "adamw_update x11 (one layer's tensors)", "adamw_update_multi (the same 11, one call)",
    "adamw_update_m16 x11 (bf16 moments)", "adamw_update_multi bf16 moments",
    "router_matmul_forward T=8192 H=2048 E=128", "router_matmul_backward din+dw",
    "router_matmul_backward din only", "router_matmul_backward dw only",
    "moe_combine_forward, then add_inplace", "moe_combine_forward with the residual",
    "rmsnorm_backward C=2048 N=8192 +dw, din +=",
    "cross_entropy_forward T=8192 V=151936", "cross_entropy_backward (in place)",
    "cross_entropy forward, then backward", "cross_entropy_fused (one pass)",
    "sumsq_f32 n=16.7M (with its sync)",
};

/* AdamW over one Qwen3-30B-A3B layer's tensors, one segment each (623M parameters): input norm,
 * q, k, v, o, q_norm, k_norm, post-attention norm, router, experts' gate_up and down */
enum { N_ADAM_SEG = 11 };
static const size_t adam_len[N_ADAM_SEG] = {
    H, (size_t)HQ * D * H, (size_t)HKV * D * H, (size_t)HKV * D * H, (size_t)H * HQ * D, D, D, H,
    (size_t)E * H, (size_t)E * 2 * I * H, (size_t)E * H * I};
static struct adamw_segment adam_seg[N_ADAM_SEG], adam_seg16[N_ADAM_SEG]; /* fp32, bf16 moments */
static size_t adam_n;

static void make_adamw(void)
{
    for (int j = 0; j < N_ADAM_SEG; j++) adam_n += adam_len[j];
    float *master = f32_random(adam_n), *grad = f32_random(adam_n), *m = f32_random(adam_n);
    float *v = be->alloc(adam_n * sizeof(float));
    be->zero(v, adam_n * sizeof(float));
    char *param = be->alloc(adam_n * be->x_size);
    uint16_t *m16 = be->alloc(adam_n * 2), *v16 = be->alloc(adam_n * 2);
    be->zero(m16, adam_n * 2), be->zero(v16, adam_n * 2);
    size_t off = 0;
    for (int j = 0; j < N_ADAM_SEG; j++) {
        const bool norm = adam_len[j] <= (size_t)H;
        adam_seg[j] = (struct adamw_segment){master + off, param + off * be->x_size, grad + off,
                                             m + off, v + off, adam_len[j], norm ? 0.0f : 0.1f, NULL};
        adam_seg16[j] = adam_seg[j];
        adam_seg16[j].m = m16 + off, adam_seg16[j].v = v16 + off;
        off += adam_len[j];
    }
}

/* bytes each call must move once */
static double op_bytes(int op)
{
    const double x = (double)be->x_size, th = (double)T * H, rh = (double)R * H;
    const double q = (double)T * HQ * D, k = (double)T * HKV * D;
    switch (op) {
    case OP_RMS_FWD_H: return 2 * th * x + T * 4.0;
    case OP_RMS_FWD_Q: return 2 * q * x + T * HQ * 4.0;
    case OP_RMS_FWD_K: return 2 * k * x + T * HKV * 4.0;
    case OP_RMS_BWD_H: return 3 * th * x + T * 4.0;
    case OP_RMS_BWD_Q: return 3 * q * x + T * HQ * 4.0;
    case OP_RMS_BWD_K: return 3 * k * x + T * HKV * 4.0;
    case OP_SWIGLU_FWD: return 3.0 * R * I * x;
    case OP_SWIGLU_BWD: return 5.0 * R * I * x;
    case OP_GATHER: return 2 * rh * x;
    case OP_GATHER_BWD: return rh * x + 2 * th * x;
    case OP_DISPATCH: return rh * x + th * x;
    case OP_COMBINE_FWD: return rh * x + th * x;
    case OP_COMBINE_BWD: return 2 * rh * x + th * x + R * 4.0;
    case OP_ROPE_FWD_Q: case OP_ROPE_BWD_Q: return 2 * q * x;
    case OP_ROPE_FWD_K: return 2 * k * x;
    case OP_RMS_ROPE_FWD_Q: return 2 * q * x + T * HQ * 4.0;
    case OP_RMS_ROPE_BWD_Q: return 3 * q * x + T * HQ * 4.0;
    case OP_RMS_ROPE_FWD_K: return 2 * k * x + T * HKV * 4.0;
    case OP_RMS_ROPE_BWD_K: return 3 * k * x + T * HKV * 4.0;
    case OP_ADD: return 3 * th * x;
    case OP_ADAMW_SEG: case OP_ADAMW_MULTI: return adam_n * (7 * 4.0 + x); /* 4 fp32 in, 3 out */
    case OP_ADAMW16_SEG: case OP_ADAMW16_MULTI: return adam_n * (3 * 4.0 + 4 * 2.0 + x);
    case OP_ROUTER_MM_FWD: return th * x + T * E * 4.0;
    case OP_ROUTER_MM_BWD: return 3 * th * x + T * E * 4.0 + 2.0 * E * H * 4.0;
    case OP_ROUTER_MM_BWD_DIN: return 2 * th * x + T * E * 4.0;
    case OP_ROUTER_MM_BWD_DW: return th * x + T * E * 4.0 + 2.0 * E * H * 4.0;
    case OP_COMBINE_THEN_ADD: case OP_COMBINE_RESID: return rh * x + 2 * th * x;
    case OP_RMS_BWD_H_ACC: return 4 * th * x + T * 4.0;
    case OP_CE_FWD: return (double)T * V * x + 2 * T * 4.0;
    case OP_CE_BWD: return 2.0 * T * V * x + 2 * T * 4.0;
    case OP_CE_TWO: return 3.0 * T * V * x + 3 * T * 4.0;
    case OP_CE_FUSED: return 2.0 * T * V * x + 3 * T * 4.0;
    case OP_SUMSQ: return th * 4.0;
    default: return th * x + th * 4.0;
    }
}

static float *f_scratch; /* [T, H] fp32 for the cast */

static void run_op(int op)
{
    const float eps = 1e-6f, theta = 1e6f;
    switch (op) {
    case OP_RMS_FWD_H: be->rmsnorm_forward(x_th2, rstd_t, x_th, x_wh, T, H, eps); break;
    case OP_RMS_FWD_Q: be->rmsnorm_forward(x_q2, rstd_q, x_q, x_wd, T * HQ, D, eps); break;
    case OP_RMS_FWD_K: be->rmsnorm_forward(x_k2, rstd_k, x_k, x_wd, T * HKV, D, eps); break;
    case OP_RMS_BWD_H:
        be->rmsnorm_backward(x_th3, dw_h, x_th2, x_th, x_wh, rstd_t, T, H, false);
        break;
    case OP_RMS_BWD_Q:
        be->rmsnorm_backward(x_q3, dw_d, x_q2, x_q, x_wd, rstd_q, T * HQ, D, false);
        break;
    case OP_RMS_BWD_K:
        be->rmsnorm_backward(x_k3, dw_d, x_k2, x_k, x_wd, rstd_k, T * HKV, D, false);
        break;
    case OP_SWIGLU_FWD: be->swiglu_forward(x_act, x_gu, R, I, NULL); break;
    case OP_SWIGLU_BWD: be->swiglu_backward(x_gu2, x_act, x_gu, R, I, NULL); break;
    case OP_GATHER: be->gather_rows(x_rh, x_th, src_row, R, H); break;
    case OP_GATHER_BWD: be->gather_rows_backward(x_th3, x_rh, src_row, R, H); break;
    case OP_DISPATCH: be->dispatch_rows(x_rh, x_th, slot_row, T, K, H); break;
    case OP_COMBINE_FWD: be->moe_combine_forward(x_th3, x_rh, slot_row, cw, NULL, T, K, H); break;
    case OP_COMBINE_BWD:
        be->moe_combine_backward(x_rh2, dcw, x_th2, x_rh, slot_row, cw, T, K, H);
        break;
    case OP_ROPE_FWD_Q: be->rope_forward(x_q3, x_q3, pos, T, HQ, D, theta); break;
    case OP_ROPE_BWD_Q: be->rope_backward(x_q3, x_q3, pos, T, HQ, D, theta); break;
    case OP_ROPE_FWD_K: be->rope_forward(x_k3, x_k3, pos, T, HKV, D, theta); break;
    case OP_RMS_ROPE_FWD_Q:
        be->rmsnorm_rope_forward(x_q2, rstd_q, x_q, x_wd, pos, T, HQ, D, eps, theta);
        break;
    case OP_RMS_ROPE_BWD_Q:
        be->rmsnorm_rope_backward(x_q3, dw_d, x_q2, x_q, x_wd, rstd_q, pos, T, HQ, D, theta);
        break;
    case OP_RMS_ROPE_FWD_K:
        be->rmsnorm_rope_forward(x_k2, rstd_k, x_k, x_wd, pos, T, HKV, D, eps, theta);
        break;
    case OP_RMS_ROPE_BWD_K:
        be->rmsnorm_rope_backward(x_k3, dw_d, x_k2, x_k, x_wd, rstd_k, pos, T, HKV, D, theta);
        break;
    case OP_ADD: be->add_inplace(x_th3, x_th2, (size_t)T * H); break;
    case OP_ADAMW_SEG:
        for (int j = 0; j < N_ADAM_SEG; j++) {
            const struct adamw_segment *g = &adam_seg[j];
            be->adamw_update(g->master, g->param, g->grad, g->m, g->v, g->n, 1e-4f, 0.9f, 0.95f,
                             1e-8f, g->weight_decay, 3, 1.0f);
        }
        break;
    case OP_ADAMW_MULTI:
        be->adamw_update_multi(adam_seg, N_ADAM_SEG, sizeof(float), 1e-4f, 0.9f, 0.95f, 1e-8f, 3, 1.0f);
        break;
    case OP_ADAMW16_SEG:
        for (int j = 0; j < N_ADAM_SEG; j++) {
            const struct adamw_segment *g = &adam_seg16[j];
            be->adamw_update_m16(g->master, g->param, g->grad, g->m, g->v, g->n, 1e-4f, 0.9f, 0.95f,
                                 1e-8f, g->weight_decay, 3, 1.0f);
        }
        break;
    case OP_ADAMW16_MULTI:
        be->adamw_update_multi(adam_seg16, N_ADAM_SEG, 2, 1e-4f, 0.9f, 0.95f, 1e-8f, 3, 1.0f);
        break;
    case OP_ROUTER_MM_FWD: be->router_matmul_forward(f_logits, x_th, x_we, T, H, E); break;
    case OP_ROUTER_MM_BWD:
        be->router_matmul_backward(x_th3, f_dw_router, f_logits, x_th, x_we, T, H, E, true);
        break;
    case OP_ROUTER_MM_BWD_DIN:
        be->router_matmul_backward(x_th3, NULL, f_logits, x_th, x_we, T, H, E, true);
        break;
    case OP_ROUTER_MM_BWD_DW:
        be->router_matmul_backward(NULL, f_dw_router, f_logits, x_th, x_we, T, H, E, true);
        break;
    case OP_COMBINE_THEN_ADD:
        be->moe_combine_forward(x_th3, x_rh, slot_row, cw, NULL, T, K, H);
        be->add_inplace(x_th3, x_th2, (size_t)T * H);
        break;
    case OP_COMBINE_RESID: be->moe_combine_forward(x_th3, x_rh, slot_row, cw, x_th2, T, K, H); break;
    case OP_RMS_BWD_H_ACC:
        be->rmsnorm_backward(x_th3, dw_h, x_th2, x_th, x_wh, rstd_t, T, H, true);
        break;
    case OP_CE_FWD: be->cross_entropy_forward(ce_loss, ce_lse, ce_z, ce_tgt, T, V); break;
    case OP_CE_BWD: be->cross_entropy_backward(ce_z, ce_z, ce_lse, ce_tgt, T, V, 1.0f / T); break;
    case OP_CE_FUSED: be->cross_entropy_fused(ce_loss, ce_lse, ce_z, ce_tgt, T, V, 1.0f / T); break;
    case OP_CE_TWO:
        be->cross_entropy_forward(ce_loss, ce_lse, ce_z, ce_tgt, T, V);
        be->cross_entropy_backward(ce_z, ce_z, ce_lse, ce_tgt, T, V, 1.0f / T);
        break;
    case OP_SUMSQ: (void)be->sumsq_f32(f_scratch, (size_t)T * H); break;
    default: be->cast_x_to_f32(f_scratch, x_th, (size_t)T * H); break;
    }
}

/* median microseconds per call */
static double time_op(int op, int reps)
{
    return bench_median_us(be, run_op, op, WARM_BATCHES, BATCH, reps);
}

int main(int argc, char **argv)
{
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    const bool fp32 = argc > 2 && !strcmp(argv[2], "fp32");
    const char *only = argc > 3 ? argv[3] : NULL;
    if (reps < 1) {
        fprintf(stderr, "usage: bench_ops [reps [fp32|bf16 [name part]]]\n");
        return 2;
    }
    be = backend_cuda(fp32, 0);
    if (!be) {
        printf("bench_ops: no CUDA backend (not built with CUDA, or no GPU), nothing to time\n");
        return 0;
    }

    mt_rng rng;
    mt_rng_seed(&rng, 7);
    float *h = mt_malloc((size_t)RAND_BLOCK * sizeof *h);
    for (int i = 0; i < RAND_BLOCK; i++) h[i] = (float)mt_rng_normal(&rng);
    rand_f32 = be->alloc((size_t)RAND_BLOCK * sizeof(float));
    be->upload(rand_f32, h, (size_t)RAND_BLOCK * sizeof(float));
    free(h);

    const size_t th = (size_t)T * H, rh = (size_t)R * H, nq = (size_t)T * HQ * D, nk = (size_t)T * HKV * D;
    x_th = x_random(th), x_th2 = x_random(th), x_th3 = x_random(th);
    x_rh = x_random(rh), x_rh2 = x_random(rh);
    x_gu = x_random((size_t)R * 2 * I), x_gu2 = x_random((size_t)R * 2 * I);
    x_act = x_random((size_t)R * I);
    x_q = x_random(nq), x_q2 = x_random(nq), x_q3 = x_random(nq);
    x_k = x_random(nk), x_k2 = x_random(nk), x_k3 = x_random(nk);
    x_wh = x_random(H), x_wd = x_random(D);
    rstd_t = f32_random(T), rstd_q = f32_random((size_t)T * HQ), rstd_k = f32_random((size_t)T * HKV);
    dw_h = f32_random(H), dw_d = f32_random(D);
    cw = f32_random(R), dcw = be->alloc((size_t)R * sizeof(float));
    f_scratch = be->alloc(th * sizeof(float));
    x_we = x_random((size_t)E * H);
    f_logits = f32_random((size_t)T * E), f_dw_router = f32_random((size_t)E * H);
    make_route();
    make_adamw();
    ce_z = x_random((size_t)T * V), ce_loss = f32_random(T), ce_lse = f32_random(T);
    int32_t *tg = mt_malloc((size_t)T * sizeof *tg);
    for (int t = 0; t < T; t++) tg[t] = (int32_t)((t * 7919u) % V);
    ce_tgt = be->alloc((size_t)T * sizeof(int32_t));
    be->upload(ce_tgt, tg, (size_t)T * sizeof(int32_t));
    free(tg);
    /* realistic rstd for the backward: the forward's */
    run_op(OP_RMS_FWD_H), run_op(OP_RMS_FWD_Q), run_op(OP_RMS_FWD_K);
    be->sync();

    printf("bench_ops: %s mode, %d samples of %d calls (median per call)\n", fp32 ? "fp32" : "bf16",
           reps, BATCH);
    printf("%-42s %10s %10s %10s\n", "op", "us/call", "MB", "GB/s");
    for (int op = 0; op < OP_COUNT; op++) {
        if (only && !strstr(op_name[op], only)) continue;
        const double us = time_op(op, reps), bytes = op_bytes(op);
        printf("%-42s %10.1f %10.1f %10.0f\n", op_name[op], us, bytes / 1e6, bytes / (us * 1e3));
        fflush(stdout);
    }

    void *bufs[] = {x_th, x_th2, x_th3, x_rh, x_rh2, x_gu, x_gu2, x_act, x_q, x_q2, x_q3, x_k,
                    x_k2, x_k3, x_wh, x_wd, rstd_t, rstd_q, rstd_k, dw_h, dw_d, cw, dcw, f_scratch,
                    src_row, slot_row, pos, rand_f32, x_we, f_logits, f_dw_router, ce_z, ce_tgt,
                    ce_loss, ce_lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(bufs[i]);
    be->free(adam_seg[0].master), be->free((void *)adam_seg[0].grad), be->free(adam_seg[0].m);
    be->free(adam_seg[0].v), be->free(adam_seg[0].param);
    be->free(adam_seg16[0].m), be->free(adam_seg16[0].v);
    return 0;
}
