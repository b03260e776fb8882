/* The step's GEMM kinds and the attention, each run back to back for SECS seconds so that the card
 * settles at its power cap, at the bench's shapes per micro-step (8,192 tokens, hidden 2048; the
 * expert layer's 65,536 rows over 128 experts of width 768, balanced; attention B=2, S=4096, 32/4
 * heads of 128). At the cap a kernel's speed is its work per joule, which a short micro-benchmark
 * at the boost clock does not show: halving the L2 reads of the grouped GEMMs' weight tiles was
 * worth ~230 MHz there and nothing in bench_grouped_gemm (docs/benchmarks.md, sixty-first session).
 *
 *   bench_soak [SECS] [KIND ...]   SECS default 6; KINDs (default all): gg_fwd_gu gg_dgrad_gu
 *                                  gg_fwd_dn gg_dgrad_dn gg_wgrad8_gu lt_q lt_lm lt_gu lt_dn
 *                                  cb_gu cb_dn cb_dgrad_gu gg_wgrad8d_gu gg_wgrad1c_gu cb_wgrad8_gu
 *                                  attn_fwd attn_bwd
 *
 * Prints "device NAME sms N flop_per_clock F" (dense bf16 FLOP an SM a clock: 4096 on sm_90, 2048
 * before), then a line a kind: "phase KIND T0 T1 T2 N calls, US us a call, X TFLOPS", the wall-clock
 * (epoch seconds) start, the start of the measured second half, and its end.
 * scripts/bench-soak.sh samples nvidia-smi beside it and adds each phase's SM clock, power and share
 * of the tensor pipe per clock. gg_* are the Hopper grouped kernel's (skipped, and said so, on the
 * sm_80 path); lt_* the backend's tuned cuBLASLt GEMMs: the q projection, the LM head forward, and
 * lt_gu / lt_dn, the expert forwards' rows and widths as one dense GEMM with one expert's weights.
 * cb_gu / cb_dn are cublasGemmStridedBatchedEx over the 128 experts' weights and 512 rows each:
 * the same operands and DRAM traffic as gg_fwd_gu / gg_fwd_dn, the library's grouped speed at the
 * cap (the dense lt_gu / lt_dn read 0.8 GB less from DRAM a call, which the cap rewards); cb_dgrad_gu
 * the same for gg_dgrad_gu. gg_wgrad8_gu's eight sets are one set's rows eight times (as the L2
 * sees a set re-read); gg_wgrad8d_gu takes eight distinct sets (3.7 GB), gg_wgrad1c_gu the same
 * bytes as one set of 4096 rows an expert, and cb_wgrad8_gu is the library's batch over the experts
 * in that layout (dw overwritten).
 * Without CUDA or a GPU it says so and exits 0. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "common.h"
#include "ops.h"

static const char *const KIND_NAMES[] = {"gg_fwd_gu", "gg_dgrad_gu", "gg_fwd_dn", "gg_dgrad_dn", "gg_wgrad8_gu",
                                          "lt_q",      "lt_lm",       "lt_gu",     "lt_dn",
                                          "cb_gu",     "cb_dn",       "cb_dgrad_gu", "gg_wgrad8d_gu",
                                          "gg_wgrad1c_gu", "cb_wgrad8_gu", "attn_fwd", "attn_bwd"};
enum { NKINDS = sizeof KIND_NAMES / sizeof KIND_NAMES[0] };

/* SECS and the kinds asked for (all when none is named); a bad one is an error naming it */
static double parse_args(int argc, char **argv, bool want[NKINDS])
{
    const double secs = argc > 1 ? atof(argv[1]) : 6;
    if (!(secs > 0 && secs <= 600)) mt_user_error("bench_soak: SECS %s: expected a number of seconds, 0 to 600", argv[1]);
    for (int i = 0; i < NKINDS; i++) want[i] = argc <= 2;
    for (int a = 2; a < argc; a++) {
        int i = 0;
        while (i < NKINDS && strcmp(KIND_NAMES[i], argv[a])) i++;
        if (i == NKINDS) mt_user_error("bench_soak: unknown kind '%s'", argv[a]);
        want[i] = true;
    }
    return secs;
}

#ifdef MT_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "../cuda/grouped_gemm.cuh"

enum { E = 128, H = 2048, F = 768, R = 65536, T = 8192, Q = 4096, KV = 512, V = 151936, SETS = 8 };

static const struct backend *be;

/* the wall clock as epoch seconds: nvidia-smi's samples carry the same clock */
static double now_epoch(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *x_r, *gu_r, *w_gu, *act_r, *y_r, *w_dn, *x_t, *q_w, *q_out, *lm_w, *lm_out;
static float *dw_gu;
static int64_t *off;
static struct expert_rows sets[SETS];
static void *aq, *ak, *av, *ao, *adq, *adk, *adv, *ado;
static float *alse;

/* n random bf16 values in [-1, 1) on the device (one 1 MiB pattern repeated) */
static void *rand_bf16(size_t n, uint64_t seed)
{
    enum { B = 1 << 19 };
    uint16_t *h = (uint16_t *)mt_malloc((size_t)B * 2);
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    for (size_t i = 0; i < B; i++) {
        const float f = 2.0f * mt_rng_uniform(&rng) - 1.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    char *d = (char *)be->alloc(n * 2);
    for (size_t o = 0; o < n; o += B) be->upload(d + 2 * o, h, 2 * (n - o < B ? n - o : B));
    free(h);
    return d;
}

static bool k_fwd_gu(void) { return grouped_gemm_forward(gu_r, x_r, w_gu, off, NULL, R, E, H, 2 * F); }
static bool k_dgrad_gu(void) { return grouped_gemm_dgrad(x_r, gu_r, w_gu, off, R, E, H, 2 * F); }
static bool k_fwd_dn(void) { return grouped_gemm_forward(y_r, act_r, w_dn, off, NULL, R, E, F, H); }
static bool k_dgrad_dn(void) { return grouped_gemm_dgrad(act_r, y_r, w_dn, off, R, E, F, H); }
static bool k_wgrad8_gu(void) { return grouped_gemm_wgrad_sets(dw_gu, sets, SETS, E, H, 2 * F, true, NULL); }
static bool k_lt_q(void) { be->matmul_forward(q_out, x_t, q_w, T, H, Q); return true; }
static bool k_lt_lm(void) { be->matmul_forward(lm_out, x_t, lm_w, T, H, V); return true; }
/* the grouped forwards' operands as one dense GEMM: w_gu / w_dn's first expert for all R rows */
static bool k_lt_gu(void) { be->matmul_forward(gu_r, x_r, w_gu, R, H, 2 * F); return true; }
static bool k_lt_dn(void) { be->matmul_forward(y_r, act_r, w_dn, R, F, H); return true; }
/* out[rows of e] = in[rows of e] · W[e]ᵀ for E experts of R / E rows, column-major: C (O x rows) =
 * op(W as K x O)ᵀ · (in as K x rows), one strided batch */
static cublasHandle_t blas;
static bool cb_forward(void *out, const void *in, const void *w, int I, int O)
{
    const float one = 1.0f, zero = 0.0f;
    const int rows = R / E;
    return cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, O, rows, I, &one, w, CUDA_R_16BF, I,
                                      (long long)O * I, in, CUDA_R_16BF, I, (long long)rows * I, &zero, out,
                                      CUDA_R_16BF, O, (long long)rows * O, E, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}
static bool k_cb_gu(void) { return cb_forward(gu_r, x_r, w_gu, H, 2 * F); }
static bool k_cb_dn(void) { return cb_forward(y_r, act_r, w_dn, F, H); }
/* din[rows of e] = dout[rows of e] · W[e]: C (I x rows) = (W as I x O) · (dout as O x rows) */
static bool k_cb_dgrad_gu(void)
{
    const float one = 1.0f, zero = 0.0f;
    const int rows = R / E, I = H, O = 2 * F;
    return cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, I, rows, O, &one, w_gu, CUDA_R_16BF, I,
                                      (long long)O * I, gu_r, CUDA_R_16BF, O, (long long)rows * O, &zero, x_r,
                                      CUDA_R_16BF, I, (long long)rows * I, E, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}
/* eight distinct micro-steps' rows: x8 [SETS * R, H], dy8 [SETS * R, 2F], allocated on first use */
static void *x8, *dy8;
static struct expert_rows sets8[SETS], contig; /* contig: the same bytes, SETS * R / E rows an expert */
static void wgrad8_inputs(void)
{
    if (x8) return;
    x8 = rand_bf16((size_t)SETS * R * H, 14), dy8 = rand_bf16((size_t)SETS * R * 2 * F, 15);
    for (int s = 0; s < SETS; s++)
        sets8[s] = (struct expert_rows){(char *)dy8 + (size_t)s * R * 2 * F * 2, (char *)x8 + (size_t)s * R * H * 2,
                                        off, R};
    int64_t h_off[E + 1];
    for (int e = 0; e <= E; e++) h_off[e] = (int64_t)e * (SETS * R / E);
    int64_t *d_off = (int64_t *)be->alloc(sizeof h_off);
    be->upload(d_off, h_off, sizeof h_off);
    contig = (struct expert_rows){dy8, x8, d_off, (int64_t)SETS * R};
}
static bool k_wgrad1c_gu(void)
{
    wgrad8_inputs();
    return grouped_gemm_wgrad_sets(dw_gu, &contig, 1, E, H, 2 * F, true, NULL);
}
static bool k_wgrad8d_gu(void)
{
    wgrad8_inputs();
    return grouped_gemm_wgrad_sets(dw_gu, sets8, SETS, E, H, 2 * F, true, NULL);
}
/* dw[e] = dy_eᵀ · x_e over SETS * R / E rows an expert (the same buffers read as whole experts):
 * C (I x O, fp32) = (x as I x rows) · (dy as O x rows)ᵀ */
static bool k_cb_wgrad8_gu(void)
{
    wgrad8_inputs();
    const float one = 1.0f, zero = 0.0f;
    const int rows = SETS * (R / E), I = H, O = 2 * F;
    return cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, O, rows, &one, x8, CUDA_R_16BF, I,
                                      (long long)rows * I, dy8, CUDA_R_16BF, O, (long long)rows * O, &zero, dw_gu,
                                      CUDA_R_32F, I, (long long)O * I, E, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}
static bool k_attn_fwd(void) { be->attention_forward(ao, alse, aq, ak, av, 2, T / 2, 32, 4, 128, NULL); return true; }
static bool k_attn_bwd(void)
{
    be->attention_backward(adq, adk, adv, ado, aq, ak, av, ao, alse, 2, T / 2, 32, 4, 128, NULL, NULL, 0);
    return true;
}

/* causal attention FLOPs as src/flops.c counts them: 4 B S^2 Hq D / 2 forward, 2.5x that backward */
#define ATTN_FWD_FLOP (4.0 * 2 * (T / 2.0) * (T / 2.0) * 32 * 128 / 2)

/* in KIND_NAMES' order */
static const struct kind {
    bool (*run)(void);
    double flop;
    bool hopper; /* the grouped kernel: Hopper only */
} KINDS[NKINDS] = {
    {k_fwd_gu, 2.0 * R * H * 2 * F, true},
    {k_dgrad_gu, 2.0 * R * H * 2 * F, true},
    {k_fwd_dn, 2.0 * R * F * H, true},
    {k_dgrad_dn, 2.0 * R * F * H, true},
    {k_wgrad8_gu, SETS * 2.0 * R * H * 2 * F, true},
    {k_lt_q, 2.0 * T * H * Q, false},
    {k_lt_lm, 2.0 * T * H * V, false},
    {k_lt_gu, 2.0 * R * H * 2 * F, false},
    {k_lt_dn, 2.0 * R * F * H, false},
    {k_cb_gu, 2.0 * R * H * 2 * F, false},
    {k_cb_dn, 2.0 * R * F * H, false},
    {k_cb_dgrad_gu, 2.0 * R * H * 2 * F, false},
    {k_wgrad8d_gu, SETS * 2.0 * R * H * 2 * F, true},
    {k_wgrad1c_gu, SETS * 2.0 * R * H * 2 * F, true},
    {k_cb_wgrad8_gu, SETS * 2.0 * R * H * 2 * F, false},
    {k_attn_fwd, ATTN_FWD_FLOP, false},
    {k_attn_bwd, 2.5 * ATTN_FWD_FLOP, false},
};

static void setup(void)
{
    x_r = rand_bf16((size_t)R * H, 1), gu_r = rand_bf16((size_t)R * 2 * F, 2);
    w_gu = rand_bf16((size_t)E * 2 * F * H, 3);
    act_r = rand_bf16((size_t)R * F, 4), y_r = rand_bf16((size_t)R * H, 5), w_dn = rand_bf16((size_t)E * H * F, 6);
    dw_gu = (float *)be->alloc((size_t)E * 2 * F * H * 4);
    x_t = rand_bf16((size_t)T * H, 7), q_w = rand_bf16((size_t)Q * H, 8), q_out = be->alloc((size_t)T * Q * 2);
    lm_w = rand_bf16((size_t)V * H, 9), lm_out = be->alloc((size_t)T * V * 2);
    int64_t h_off[E + 1];
    for (int e = 0; e <= E; e++) h_off[e] = (int64_t)e * (R / E);
    off = (int64_t *)be->alloc(sizeof h_off);
    be->upload(off, h_off, sizeof h_off);
    for (int s = 0; s < SETS; s++) sets[s] = (struct expert_rows){gu_r, x_r, off, R};
    aq = rand_bf16((size_t)T * Q, 10), ak = rand_bf16((size_t)T * KV, 11), av = rand_bf16((size_t)T * KV, 12);
    ado = rand_bf16((size_t)T * Q, 13);
    ao = be->alloc((size_t)T * Q * 2), adq = be->alloc((size_t)T * Q * 2);
    adk = be->alloc((size_t)T * KV * 2), adv = be->alloc((size_t)T * KV * 2);
    alse = (float *)be->alloc((size_t)2 * 32 * (T / 2) * 4);
}

/* k back to back for secs: the first half settles the clock, the second is timed */
static void soak(const char *name, const struct kind *k, double secs)
{
    const double t0 = now_epoch();
    while (now_epoch() - t0 < secs / 2) {
        k->run();
        be->sync();
    }
    const double t1 = now_epoch();
    long n = 0;
    while (now_epoch() - t1 < secs / 2) {
        for (int i = 0; i < 4; i++) k->run();
        n += 4;
        be->sync();
    }
    const double t2 = now_epoch();
    printf("phase %s %.3f %.3f %.3f %ld calls, %.1f us a call, %.0f TFLOPS\n", name, t0, t1, t2, n,
           (t2 - t1) / n * 1e6, k->flop * n / (t2 - t1) * 1e-12);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    bool want[NKINDS];
    const double secs = parse_args(argc, argv, want);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("bench_soak: no GPU here; nothing measured\n");
        return 0;
    }
    be = backend_cuda(false, 0);
    if (!be) {
        printf("bench_soak: the CUDA backend did not start; nothing measured\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CUDA_CALL(cudaGetDeviceProperties(&prop, 0));
    printf("device %s sms %d flop_per_clock %d\n", prop.name, prop.multiProcessorCount, prop.major >= 9 ? 4096 : 2048);
    setup();
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(blas, (cudaStream_t)grouped_gemm_stream()) != CUBLAS_STATUS_SUCCESS)
        mt_user_error("bench_soak: cuBLAS did not start");
    const bool hopper = grouped_gemm_available();
    for (int i = 0; i < NKINDS; i++) {
        if (!want[i]) continue;
        if (KINDS[i].hopper && !hopper) {
            printf("skipped %s: the grouped kernel runs on Hopper only\n", KIND_NAMES[i]);
            continue;
        }
        if (!KINDS[i].run()) /* the first call: tuning, tensor maps */
            mt_user_error("bench_soak: %s: the GEMM was refused", KIND_NAMES[i]);
        be->sync();
        sleep(2); /* a cooler start for each kind */
        soak(KIND_NAMES[i], &KINDS[i], secs);
    }
    return 0;
}
#else
int main(int argc, char **argv)
{
    bool want[NKINDS];
    parse_args(argc, argv, want);
    printf("bench_soak: built without CUDA; nothing measured\n");
    return 0;
}
#endif
