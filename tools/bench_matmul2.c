/* Micro-benchmark of attention's k and v projections at the bench shape (T = 8192 tokens,
 * H = 2048, 4 kv heads of 128: N = 512 outputs each) as two matmul calls against one matmul2 call
 * (ops.h; on CUDA one strided-batched cuBLASLt GEMM running the single GEMM's algorithm), with
 * the q projection (N = 4096) for scale:
 *
 *   bench_matmul2 [reps [fp32]]   (default 20 timed samples, bf16)
 *
 *   forward      out_k = a Wkᵀ, out_v = a Wvᵀ
 *   wgrad        dWk += dkᵀ a, dWv += dvᵀ a (fp32 dw; matmul_backward with din NULL)
 *   backward     din += dk Wk + dv Wv and the wgrad (as attention_backward calls it)
 * plus, for comparison, the forward and wgrad as one cuBLASLt call with the algorithm cuBLASLt's
 * heuristic picks for the batch of 2 (free to differ from the single GEMM's, so not bit-identical
 * in general; the "bits" column says).
 *
 * The pairs lie as in the model (weights, outputs and gradients each a then b in one buffer), so
 * every batch stride is positive. Each sample times BATCH back-to-back calls between two syncs of
 * the backend's stream (host wall clock, launch gaps hidden as in a training step); the table gives
 * the median per call after two warm-up batches. "bits" compares each one-call variant's outputs
 * with the two calls' from the same inputs and starting dw/din: "same" (every byte) or "DIFFER".
 * Without CUDA (or a GPU) it says so and exits 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "common.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include <cublasLt.h>

#include "../cuda/grouped_gemm.cuh"
#endif

enum { BATCH = 10, WARM_BATCHES = 2, T = 8192, H = 2048, OQ = 4096, OKV = 512 };

static const struct backend *be;
static bool fp32;
static void *x_a, *w_q, *out_q;          /* a [T,H], Wq [OQ,H], q [T,OQ] */
static char *w_kv, *out_kv, *dy_kv;      /* pairs: Wk|Wv [2][OKV,H], k|v and dk|dv [2][T,OKV] */
static float *dw_kv, *dw_kv0;            /* dWk|dWv [2][OKV,H] fp32 and its starting value */
static void *din, *din0;                 /* [T,H] */

#define PAIR(base, i, n, es) ((void *)((char *)(base) + (size_t)(i) * (n) * (es)))

enum {
    V_Q, V_FWD2, V_FWD_PAIR, V_FWD_LT, V_WG2, V_WG_PAIR, V_WG_LT, V_BWD2, V_BWD_PAIR, V_COUNT
};
static const char *v_name[V_COUNT] = {
    "q forward 8192x2048->4096 (scale)",
    "k,v forward: 2 x matmul_forward",
    "k,v forward: matmul2_forward",
    "k,v forward: cuBLASLt batch-2 heuristic",
    "k,v wgrad: 2 x matmul_backward",
    "k,v wgrad: matmul2_backward",
    "k,v wgrad: cuBLASLt batch-2 heuristic",
    "k,v backward: 2 x matmul_backward",
    "k,v backward: matmul2_backward",
};

static double v_flops(int v)
{
    const double kv = 2.0 * 2.0 * T * H * OKV;
    if (v == V_Q) return 2.0 * T * H * OQ;
    return v >= V_BWD2 ? 2 * kv : kv;
}

/* ---------------------------------------------------------------- cuBLASLt's own batch-2 choice */
#ifdef MT_HAVE_CUDA
enum { LT_WORKSPACE = 32 << 20 }; /* the backend's */

struct lt_batch2 {
    bool ok;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t l[3];
    cublasLtMatmulAlgo_t algo;
};

static cublasLtHandle_t lt;
static void *lt_ws;
static struct lt_batch2 lt_fwd, lt_wg;

/* column-major C[m,n] (+)= op(A) op(B) for 2 batches of strides s[A, B, C] */
static void lt_batch2_make(struct lt_batch2 *p, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, int lda, int ldb, int ldc, cudaDataType_t ab,
                           cudaDataType_t c, const int64_t s[3])
{
    LT(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const bool an = ta == CUBLAS_OP_N, bn = tb == CUBLAS_OP_N;
    LT(cublasLtMatrixLayoutCreate(&p->l[0], ab, an ? m : k, an ? k : m, lda));
    LT(cublasLtMatrixLayoutCreate(&p->l[1], ab, bn ? k : n, bn ? n : k, ldb));
    LT(cublasLtMatrixLayoutCreate(&p->l[2], c, m, n, ldc));
    const int32_t two = 2;
    for (int i = 0; i < 3; i++) {
        LT(cublasLtMatrixLayoutSetAttribute(p->l[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, sizeof two));
        LT(cublasLtMatrixLayoutSetAttribute(p->l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s[i],
                                            sizeof s[i]));
    }
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = LT_WORKSPACE;
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t res;
    int nres = 0;
    p->ok = cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->l[0], p->l[1], p->l[2], p->l[2], pref, 1,
                                           &res, &nres) == CUBLAS_STATUS_SUCCESS && nres > 0;
    if (p->ok) p->algo = res.algo;
    LT(cublasLtMatmulPreferenceDestroy(pref));
}

static void lt_batch2_run(const struct lt_batch2 *p, const void *A, const void *B, void *C, float beta)
{
    const float alpha = 1.0f;
    LT(cublasLtMatmul(lt, p->desc, &alpha, A, p->l[0], B, p->l[1], &beta, C, p->l[2], C, p->l[2],
                      &p->algo, lt_ws, LT_WORKSPACE, (cudaStream_t)grouped_gemm_stream()));
}

static void lt_setup(void)
{
    LT(cublasLtCreate(&lt));
    CUDA_CALL(cudaMalloc(&lt_ws, LT_WORKSPACE));
    const cudaDataType_t ab = fp32 ? CUDA_R_32F : CUDA_R_16BF;
    const int64_t oi = (int64_t)OKV * H, no = (int64_t)T * OKV;
    const int64_t s_fwd[3] = {oi, 0, no}, s_wg[3] = {0, no, oi};
    lt_batch2_make(&lt_fwd, CUBLAS_OP_T, CUBLAS_OP_N, OKV, T, H, H, H, OKV, ab, ab, s_fwd);
    lt_batch2_make(&lt_wg, CUBLAS_OP_N, CUBLAS_OP_T, H, OKV, T, H, OKV, H, ab, CUDA_R_32F, s_wg);
}

static bool lt_available(int v) { return v == V_FWD_LT ? lt_fwd.ok : lt_wg.ok; }
#else
static void lt_setup(void) {}
static bool lt_available(int v) { return false; }
#endif

/* ---------------------------------------------------------------- the variants */

static void run(int v)
{
    const size_t xs = be->x_size, oi = (size_t)OKV * H, no = (size_t)T * OKV;
    void *w0 = PAIR(w_kv, 0, oi, xs), *w1 = PAIR(w_kv, 1, oi, xs);
    void *y0 = PAIR(out_kv, 0, no, xs), *y1 = PAIR(out_kv, 1, no, xs);
    void *dy0 = PAIR(dy_kv, 0, no, xs), *dy1 = PAIR(dy_kv, 1, no, xs);
    float *dw0 = dw_kv, *dw1 = dw_kv + oi;
    switch (v) {
    case V_Q: be->matmul_forward(out_q, x_a, w_q, T, H, OQ); break;
    case V_FWD2:
        be->matmul_forward(y0, x_a, w0, T, H, OKV);
        be->matmul_forward(y1, x_a, w1, T, H, OKV);
        break;
    case V_FWD_PAIR: be->matmul2_forward(y0, y1, x_a, w0, w1, T, H, OKV); break;
    case V_WG2:
        be->matmul_backward(NULL, dw0, dy0, x_a, w0, T, H, OKV, false);
        be->matmul_backward(NULL, dw1, dy1, x_a, w1, T, H, OKV, false);
        break;
    case V_WG_PAIR: be->matmul2_backward(NULL, dw0, dw1, dy0, dy1, x_a, w0, w1, T, H, OKV, false); break;
    case V_BWD2:
        be->matmul_backward(din, dw0, dy0, x_a, w0, T, H, OKV, true);
        be->matmul_backward(din, dw1, dy1, x_a, w1, T, H, OKV, true);
        break;
    case V_BWD_PAIR: be->matmul2_backward(din, dw0, dw1, dy0, dy1, x_a, w0, w1, T, H, OKV, true); break;
#ifdef MT_HAVE_CUDA
    case V_FWD_LT: lt_batch2_run(&lt_fwd, w0, x_a, y0, 0.0f); break;
    case V_WG_LT: lt_batch2_run(&lt_wg, x_a, dy0, dw0, 1.0f); break;
#endif
    default: mt_fatal("bench_matmul2: variant %d has no implementation here", v);
    }
}

/* the variant's outputs (all of them: the k,v pair's out, dw and din) */
static void *outputs_of(void)
{
    const size_t xs = be->x_size, no = (size_t)T * OKV, oi = (size_t)OKV * H, ni = (size_t)T * H;
    const size_t n_out = 2 * no * xs, n_dw = 2 * oi * sizeof(float), n_din = ni * xs;
    char *h = mt_malloc(n_out + n_dw + n_din);
    be->download(h, out_kv, n_out);
    be->download(h + n_out, dw_kv, n_dw);
    be->download(h + n_out + n_dw, din, n_din);
    return h;
}

static void reset_state(void)
{
    be->copy(dw_kv, dw_kv0, 2 * (size_t)OKV * H * sizeof(float));
    be->copy(din, din0, (size_t)T * H * be->x_size);
    be->zero(out_kv, 2 * (size_t)T * OKV * be->x_size);
}

/* the one-call variant against the two calls it replaces, from the same state */
static const char *bits_vs_two_calls(int v)
{
    const int ref = v <= V_FWD_LT ? V_FWD2 : v <= V_WG_LT ? V_WG2 : V_BWD2;
    const size_t bytes = 2 * (size_t)T * OKV * be->x_size + 2 * (size_t)OKV * H * sizeof(float) +
                         (size_t)T * H * be->x_size;
    reset_state();
    run(ref);
    void *a = outputs_of();
    reset_state();
    run(v);
    void *b = outputs_of();
    const bool same = !memcmp(a, b, bytes);
    free(a), free(b);
    return same ? "same" : "DIFFER";
}

static double median_us(int v, int reps)
{
    return bench_median_us(be, run, v, WARM_BATCHES, BATCH, reps);
}

/* a compute-dtype device tensor of n normal values (scaled) */
static void *x_random(mt_rng *rng, size_t n, double scale)
{
    float *h = mt_malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = (float)(scale * mt_rng_normal(rng));
    float *tmp = be->alloc(n * sizeof(float));
    be->upload(tmp, h, n * sizeof(float));
    void *d = be->alloc(n * be->x_size);
    be->cast_f32_to_x(d, tmp, n);
    be->free(tmp);
    free(h);
    return d;
}

int main(int argc, char **argv)
{
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    fp32 = argc > 2 && !strcmp(argv[2], "fp32");
    if (reps < 1) {
        fprintf(stderr, "usage: bench_matmul2 [reps [fp32]]\n");
        return 2;
    }
    be = backend_cuda(fp32, 0);
    if (!be) {
        printf("bench_matmul2: no CUDA backend (not built with CUDA, or no GPU), nothing to time\n");
        return 0;
    }
    mt_rng rng;
    mt_rng_seed(&rng, 11);
    const size_t oi = (size_t)OKV * H, no = (size_t)T * OKV;
    x_a = x_random(&rng, (size_t)T * H, 1.0);
    w_q = x_random(&rng, (size_t)OQ * H, 0.02);
    out_q = be->alloc((size_t)T * OQ * be->x_size);
    w_kv = x_random(&rng, 2 * oi, 0.02);
    dy_kv = x_random(&rng, 2 * no, 1.0);
    out_kv = be->alloc(2 * no * be->x_size);
    din0 = x_random(&rng, (size_t)T * H, 1.0);
    din = be->alloc((size_t)T * H * be->x_size);
    dw_kv = be->alloc(2 * oi * sizeof(float));
    dw_kv0 = be->alloc(2 * oi * sizeof(float));
    be->zero(dw_kv0, 2 * oi * sizeof(float));
    lt_setup();

    printf("bench_matmul2: %s mode, %d samples of %d calls (median per call)\n",
           fp32 ? "fp32" : "bf16", reps, BATCH);
    printf("%-42s %10s %8s %8s\n", "variant", "us/call", "TFLOPS", "bits");
    for (int v = 0; v < V_COUNT; v++) {
        if ((v == V_FWD_LT || v == V_WG_LT) && !lt_available(v)) {
            printf("%-42s %10s %8s %8s\n", v_name[v], "-", "-", "no algo");
            continue;
        }
        const bool one_call = v == V_FWD_PAIR || v == V_FWD_LT || v == V_WG_PAIR || v == V_WG_LT ||
                              v == V_BWD_PAIR;
        const char *bits = one_call ? bits_vs_two_calls(v) : "-";
        const double us = median_us(v, reps);
        printf("%-42s %10.1f %8.0f %8s\n", v_name[v], us, v_flops(v) / (us * 1e6), bits);
        fflush(stdout);
    }

    void *bufs[] = {x_a, w_q, out_q, w_kv, dy_kv, out_kv, din0, din, dw_kv, dw_kv0};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) be->free(bufs[i]);
    return 0;
}
