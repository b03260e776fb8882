/* Micro-benchmark of the grouped expert GEMMs (cuda/grouped_gemm.cu) against the loop of
 * cublasGemmEx that cuda/expert_matmul.cu used before (the same column-major mapping), on the
 * expert GEMMs of one Qwen3-30B-A3B MoE layer: 65,536 rows (8,192 tokens × top-8) over 128
 * experts, hidden 2048, expert width 768 (gate_up 2048 -> 1536, down 768 -> 2048), bf16 with fp32
 * accumulation; forward (2 GEMMs) and backward (dgrad and wgrad of each, 4 GEMMs), with the rows
 * spread evenly (512 per expert) and Zipf-like (weight 1/(e+1)^0.8, as in
 * shared/bench/cublas_grouped_probe.c).
 *
 *   bench_grouped_gemm [reps]      (default 20 timed repeats after 3 warm-ups; median reported)
 *   bench_grouped_gemm 0           each GEMM once a routing, the wgrad in MT_WGRAD_MAX_SETS sets,
 *                                  nothing else (for a profiler: scripts/ncu-kernels.sh); a third
 *                                  routing there, the Zipf-like one in whole 128-row blocks
 *
 * Inputs are random bf16 in [-1, 1) (never zeros), dw starts random. Each GEMM is first run once
 * by both implementations into separate outputs and compared (‖ours − cuBLAS‖ / ‖cuBLAS‖; for dw,
 * over what the GEMM added; 0 means bit-identical, which happens when both sum K in the same
 * 16-wide steps; a NaN-poisoned element left unwritten shows as inf), then timed with CUDA events
 * on the backend's stream. Without CUDA (or without a GPU) it says so and exits 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "common.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "../cuda/grouped_gemm.cuh"

#define CB(call)                                                                                   \
    do {                                                                                           \
        cublasStatus_t cs_ = (call);                                                               \
        if (cs_ != CUBLAS_STATUS_SUCCESS) mt_fatal("%s: cuBLAS status %d", #call, (int)cs_);      \
    } while (0)

enum { E = 128, H = 2048, F = 768, R = 8192 * 8, WARM = 3 };

static cudaStream_t stream;
static cublasHandle_t blas;

/* A source of random values on the device, copied over targets in chunks. Its length is odd so
 * that the repetition does not line up with rows or columns. */
enum { SRC_N = (1 << 22) + 4093 };
static void *src_bf16;
static float *src_f32;

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void make_sources(void)
{
    mt_rng rng;
    mt_rng_seed(&rng, 4242);
    uint16_t *hb = mt_malloc(SRC_N * sizeof *hb);
    float *hf = mt_malloc(SRC_N * sizeof *hf);
    for (size_t i = 0; i < SRC_N; i++) {
        float v = (float)(mt_rng_uniform(&rng) * 2.0 - 1.0);
        if (v == 0.0f) v = 0.5f;
        hb[i] = to_bf16(v);
        hf[i] = v;
    }
    CUDA_CALL(cudaMalloc(&src_bf16, SRC_N * 2));
    CUDA_CALL(cudaMalloc((void **)&src_f32, SRC_N * 4));
    CUDA_CALL(cudaMemcpy(src_bf16, hb, SRC_N * 2, cudaMemcpyHostToDevice));
    CUDA_CALL(cudaMemcpy(src_f32, hf, SRC_N * 4, cudaMemcpyHostToDevice));
    free(hb);
    free(hf);
}

static void *dev_random(size_t n, size_t es)
{
    void *d;
    CUDA_CALL(cudaMalloc(&d, n * es));
    const void *src = es == 2 ? src_bf16 : (const void *)src_f32;
    for (size_t i = 0; i < n; i += SRC_N) {
        const size_t k = n - i < SRC_N ? n - i : SRC_N;
        CUDA_CALL(cudaMemcpy((char *)d + i * es, src, k * es, cudaMemcpyDeviceToDevice));
    }
    return d;
}

static void *dev_alloc(size_t bytes)
{
    void *d;
    CUDA_CALL(cudaMalloc(&d, bytes));
    CUDA_CALL(cudaMemset(d, 0xff, bytes)); /* NaN: an element nobody writes fails the comparison */
    return d;
}

/* one expert GEMM of the layer */
enum kind { FWD, DGRAD, WGRAD };
struct gemm {
    const char *name;
    enum kind kind;
    int I, O;
    const void *a; /* FWD: in [R,I]; DGRAD, WGRAD: dout [R,O] */
    const void *b; /* FWD, DGRAD: w [E,O,I]; WGRAD: in [R,I] */
    void *out[2];  /* ours, cuBLAS: bf16 [R,O] (FWD), bf16 [R,I] (DGRAD), fp32 dw [E,O,I] (WGRAD) */
};

/* The expert offsets in device memory, where the grouped kernel reads them (one buffer, reused:
 * the upload waits, outside any timing) */
static const int64_t *dev_offsets(const int64_t *off)
{
    static int64_t *d;
    if (!d) CUDA_CALL(cudaMalloc((void **)&d, (E + 1) * sizeof(int64_t)));
    CUDA_CALL(cudaMemcpy(d, off, (E + 1) * sizeof(int64_t), cudaMemcpyHostToDevice));
    return d;
}

static void run_ours(const struct gemm *g, const int64_t *doff, void *out)
{
    bool ok = false;
    if (g->kind == FWD) ok = grouped_gemm_forward(out, g->a, g->b, doff, NULL, R, E, g->I, g->O);
    else if (g->kind == DGRAD) ok = grouped_gemm_dgrad(out, g->a, g->b, doff, R, E, g->I, g->O);
    else ok = grouped_gemm_wgrad(out, g->a, g->b, doff, R, E, g->I, g->O, false);
    if (!ok) mt_fatal("grouped_gemm refused %s (%d -> %d)", g->name, g->I, g->O);
}

/* the cublasGemmEx loop of cuda/expert_matmul.cu */
static void run_cublas(const struct gemm *g, const int64_t *off, void *out)
{
    const float one = 1.0f, zero = 0.0f;
    const int I = g->I, O = g->O;
    for (int e = 0; e < E; e++) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        if (g->kind == FWD) {
            CB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, O, (int)n, I, &one,
                            (const uint16_t *)g->b + (size_t)e * O * I, CUDA_R_16BF, I,
                            (const uint16_t *)g->a + r0 * I, CUDA_R_16BF, I, &zero,
                            (uint16_t *)out + r0 * O, CUDA_R_16BF, O, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        } else if (g->kind == DGRAD) {
            CB(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, I, (int)n, O, &one,
                            (const uint16_t *)g->b + (size_t)e * O * I, CUDA_R_16BF, I,
                            (const uint16_t *)g->a + r0 * O, CUDA_R_16BF, O, &zero,
                            (uint16_t *)out + r0 * I, CUDA_R_16BF, I, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        } else {
            CB(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, I, O, (int)n, &one,
                            (const uint16_t *)g->b + r0 * I, CUDA_R_16BF, I,
                            (const uint16_t *)g->a + r0 * O, CUDA_R_16BF, O, &one,
                            (float *)out + (size_t)e * O * I, CUDA_R_32F, I, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        }
    }
}

static size_t out_elems(const struct gemm *g)
{
    return g->kind == FWD ? (size_t)R * g->O : g->kind == DGRAD ? (size_t)R * g->I : (size_t)E * g->O * g->I;
}

static float bf16_to_f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ‖ours − ref‖ / ‖ref‖ of two bf16 device buffers, on the host; infinite on a NaN */
static double rel_err_bf16(const void *d_ours, const void *d_ref, size_t n)
{
    uint16_t *a = mt_malloc(n * 2), *b = mt_malloc(n * 2);
    CUDA_CALL(cudaMemcpy(a, d_ours, n * 2, cudaMemcpyDeviceToHost));
    CUDA_CALL(cudaMemcpy(b, d_ref, n * 2, cudaMemcpyDeviceToHost));
    double d = 0.0, r = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double x = bf16_to_f(a[i]), y = bf16_to_f(b[i]);
        if (!isfinite(x)) {
            d = INFINITY;
            break;
        }
        d += (x - y) * (x - y);
        r += y * y;
    }
    free(a);
    free(b);
    return sqrt(d / r);
}

/* the same for fp32 dw, over what each added to dw0, on the device through cuBLAS (dw is
 * 400M elements): ours −= ref, ref −= dw0, then the two norms. Destroys both buffers' values. */
static double rel_err_dw(float *ours, float *ref, const float *dw0, size_t n)
{
    const float minus = -1.0f;
    float dn = 0.0f, rn = 0.0f;
    CB(cublasSetPointerMode(blas, CUBLAS_POINTER_MODE_HOST));
    for (size_t i = 0; i < n; i += 1u << 30) {
        const int k = (int)(n - i < (1u << 30) ? n - i : (1u << 30));
        float a = 0.0f, b = 0.0f;
        CB(cublasSaxpy(blas, k, &minus, ref + i, 1, ours + i, 1));
        CB(cublasSaxpy(blas, k, &minus, dw0 + i, 1, ref + i, 1));
        CB(cublasSnrm2(blas, k, ours + i, 1, &a));
        CB(cublasSnrm2(blas, k, ref + i, 1, &b));
        dn = hypotf(dn, a);
        rn = hypotf(rn, b);
    }
    return isfinite(dn) ? (double)dn / rn : INFINITY;
}

/* median milliseconds of `reps` runs after WARM warm-ups */
static float time_ms(const struct gemm *g, const int64_t *off, const int64_t *doff, int which,
                     int reps, cudaEvent_t t0, cudaEvent_t t1)
{
    float *ms = mt_malloc((size_t)reps * sizeof *ms);
    for (int r = -WARM; r < reps; r++) {
        CUDA_CALL(cudaEventRecord(t0, stream));
        if (which == 0) run_ours(g, doff, g->out[0]);
        else run_cublas(g, off, g->out[1]);
        CUDA_CALL(cudaEventRecord(t1, stream));
        CUDA_CALL(cudaEventSynchronize(t1));
        if (r >= 0) CUDA_CALL(cudaEventElapsedTime(&ms[r], t0, t1));
    }
    CUDA_CALL(cudaGetLastError());
    bench_sort_floats(ms, reps);
    const float m = ms[reps / 2];
    free(ms);
    return m;
}

static void bench(const char *dist, const int *rows, struct gemm *g, int ng, const float *dw0[2],
                  int reps)
{
    int64_t off[E + 1] = {0};
    int mx = 0, mn = R;
    for (int e = 0; e < E; e++) {
        off[e + 1] = off[e] + rows[e];
        if (rows[e] > mx) mx = rows[e];
        if (rows[e] < mn) mn = rows[e];
    }
    if (off[E] != R) mt_fatal("bench: row counts add up to %lld, not %d", (long long)off[E], R);
    const int64_t *doff = dev_offsets(off);
    printf("\n%s: %d rows over %d experts (%d .. %d per expert)\n", dist, R, E, mn, mx);
    printf("%-16s %-11s %9s %8s %9s %8s %7s %9s\n", "gemm", "I -> O", "ours ms", "TFLOPS",
           "cuBLAS ms", "TFLOPS", "speedup", "rel err");
    cudaEvent_t t0, t1;
    CUDA_CALL(cudaEventCreate(&t0));
    CUDA_CALL(cudaEventCreate(&t1));
    double tot[2][2] = {{0}}, flop_tot[2] = {0}; /* [fwd, bwd][ours, cublas] */
    for (int i = 0; i < ng; i++) {
        const size_t n = out_elems(&g[i]);
        const double flop = 2.0 * R * g[i].I * g[i].O;
        /* correctness: one run of each from the same start */
        double err;
        if (g[i].kind == WGRAD) {
            const float *d0 = g[i].O == 2 * F ? dw0[0] : dw0[1];
            CUDA_CALL(cudaMemcpyAsync(g[i].out[0], d0, n * 4, cudaMemcpyDeviceToDevice, stream));
            CUDA_CALL(cudaMemcpyAsync(g[i].out[1], d0, n * 4, cudaMemcpyDeviceToDevice, stream));
            run_ours(&g[i], doff, g[i].out[0]);
            run_cublas(&g[i], off, g[i].out[1]);
            err = rel_err_dw(g[i].out[0], g[i].out[1], d0, n);
        } else {
            CUDA_CALL(cudaMemsetAsync(g[i].out[0], 0xff, n * 2, stream));
            CUDA_CALL(cudaMemsetAsync(g[i].out[1], 0xff, n * 2, stream));
            run_ours(&g[i], doff, g[i].out[0]);
            run_cublas(&g[i], off, g[i].out[1]);
            CUDA_CALL(cudaStreamSynchronize(stream));
            err = rel_err_bf16(g[i].out[0], g[i].out[1], n);
        }
        CUDA_CALL(cudaStreamSynchronize(stream));
        CUDA_CALL(cudaGetLastError());
        const float a = time_ms(&g[i], off, doff, 0, reps, t0, t1);
        const float b = time_ms(&g[i], off, doff, 1, reps, t0, t1);
        char io[32];
        snprintf(io, sizeof io, "%d -> %d", g[i].I, g[i].O);
        printf("%-16s %-11s %9.3f %8.0f %9.3f %8.0f %6.2fx %9.2e\n", g[i].name, io, a,
               flop / a / 1e9, b, flop / b / 1e9, b / a, err);
        const int bw = g[i].kind != FWD;
        tot[bw][0] += a, tot[bw][1] += b, flop_tot[bw] += flop;
    }
    for (int bw = 0; bw < 2; bw++)
        printf("%-16s %-11s %9.3f %8.0f %9.3f %8.0f %6.2fx\n", bw ? "backward (4)" : "forward (2)",
               "", tot[bw][0], flop_tot[bw] / tot[bw][0] / 1e9, tot[bw][1],
               flop_tot[bw] / tot[bw][1] / 1e9, tot[bw][1] / tot[bw][0]);
    CUDA_CALL(cudaEventDestroy(t0));
    CUDA_CALL(cudaEventDestroy(t1));
}

/* parallel.expert_wgrad_pairs / expert_wgrad_group: MT_WGRAD_MAX_SETS micro-steps' weight gradients
 * of one GEMM, as one wgrad call per micro-step, as calls of two row sets (pairs), of four, and (where
 * the kernel takes them) of eight; each micro-step's rows in buffers of their own, as in training
 * (the same rows again are reread from the L2, which overstated the group's gain: 1.28x against two
 * pairs, H200); median ms of `reps` after WARM, TFLOPS of all the micro-steps */
static void bench_groups(const char *label, const int *rows, const struct gemm *g, int n, int reps)
{
    enum { SETS = MT_WGRAD_MAX_SETS };
    static const int groups[] = {1, 2, 4, 8};
    const int nv = SETS >= 8 ? 4 : 3;
    int64_t off[E + 1];
    off[0] = 0;
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + rows[e];
    const int64_t *doff = dev_offsets(off);
    cudaEvent_t t0, t1;
    CUDA_CALL(cudaEventCreate(&t0));
    CUDA_CALL(cudaEventCreate(&t1));
    printf("\n%s, %d micro-steps' wgrad (parallel.expert_wgrad_pairs, expert_wgrad_group): ms (TFLOPS) "
           "by calls of g sets\n",
           label, SETS);
    printf("%-16s %-11s", "GEMM", "I -> O");
    for (int v = 0; v < nv; v++) printf("        g=%d       ", groups[v]);
    printf(" %s\n", nv > 3 ? "4/8" : "2/4");
    for (int i = 0; i < n; i++) {
        if (g[i].kind != WGRAD) continue;
        struct expert_rows sets[SETS] = {{g[i].a, g[i].b, doff, R}};
        for (int k = 1; k < SETS; k++)
            sets[k] = (struct expert_rows){dev_random((size_t)R * g[i].O, 2), dev_random((size_t)R * g[i].I, 2),
                                           doff, R};
        float ms[4];
        for (int v = 0; v < nv; v++) {
            float *t = mt_malloc((size_t)reps * sizeof *t);
            const int group = groups[v];
            for (int r = 0; r < WARM + reps; r++) {
                CUDA_CALL(cudaEventRecord(t0, stream));
                bool ok = true;
                for (int k = 0; k < SETS; k += group)
                    ok = ok && grouped_gemm_wgrad_sets(g[i].out[0], sets + k, group, E, g[i].I, g[i].O, false, NULL);
                if (!ok) mt_fatal("grouped_gemm refused %s", g[i].name);
                CUDA_CALL(cudaEventRecord(t1, stream));
                CUDA_CALL(cudaEventSynchronize(t1));
                if (r >= WARM) CUDA_CALL(cudaEventElapsedTime(&t[r - WARM], t0, t1));
            }
            bench_sort_floats(t, reps);
            ms[v] = t[reps / 2];
            free(t);
        }
        const double flop = SETS * 2.0 * (double)R * g[i].I * g[i].O;
        char io[32];
        snprintf(io, sizeof io, "%d -> %d", g[i].I, g[i].O);
        printf("%-16s %-11s", g[i].name, io);
        for (int v = 0; v < nv; v++) printf(" %8.3f (%5.0f)  ", ms[v], flop / ms[v] / 1e9);
        printf(" %5.2fx\n", ms[nv - 2] / ms[nv - 1]);
        for (int k = 1; k < SETS; k++) {
            CUDA_CALL(cudaFree((void *)sets[k].dout));
            CUDA_CALL(cudaFree((void *)sets[k].in));
        }
    }
    CUDA_CALL(cudaEventDestroy(t0));
    CUDA_CALL(cudaEventDestroy(t1));
}

/* `bench_grouped_gemm 0`: each GEMM once at each routing, the wgrad as one call of
 * MT_WGRAD_MAX_SETS micro-steps' row sets (as training groups them at the bench shape), and nothing
 * else: the launches a profiler sees (scripts/ncu-kernels.sh), in the order printed here */
static void profile_once(const char *label, const int *rows, const struct gemm *g, int n)
{
    enum { SETS = MT_WGRAD_MAX_SETS };
    int64_t off[E + 1];
    off[0] = 0;
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + rows[e];
    const int64_t *doff = dev_offsets(off);
    for (int i = 0; i < n; i++) {
        if (g[i].kind != WGRAD) {
            run_ours(&g[i], doff, g[i].out[0]);
            printf("launch: %s %s\n", label, g[i].name);
            continue;
        }
        struct expert_rows sets[SETS] = {{g[i].a, g[i].b, doff, R}};
        for (int k = 1; k < SETS; k++)
            sets[k] = (struct expert_rows){dev_random((size_t)R * g[i].O, 2), dev_random((size_t)R * g[i].I, 2),
                                           doff, R};
        if (!grouped_gemm_wgrad_sets(g[i].out[0], sets, SETS, E, g[i].I, g[i].O, false, NULL))
            mt_fatal("grouped_gemm refused %s in %d sets", g[i].name, SETS);
        printf("launch: %s %s (%d sets)\n", label, g[i].name, SETS);
        CUDA_CALL(cudaStreamSynchronize(stream));
        for (int k = 1; k < SETS; k++) {
            CUDA_CALL(cudaFree((void *)sets[k].dout));
            CUDA_CALL(cudaFree((void *)sets[k].in));
        }
    }
    CUDA_CALL(cudaStreamSynchronize(stream));
    CUDA_CALL(cudaGetLastError());
}

static int run_bench(int reps)
{
    const struct backend *be = backend_cuda(false, 0);
    if (!be) {
        printf("bench_grouped_gemm: no CUDA device; nothing to measure\n");
        return 0;
    }
    stream = (cudaStream_t)grouped_gemm_stream();
    CB(cublasCreate(&blas));
    CB(cublasSetStream(blas, stream));
    make_sources();

    const size_t wgu = (size_t)E * 2 * F * H, wd = (size_t)E * H * F;
    void *x = dev_random((size_t)R * H, 2), *act = dev_random((size_t)R * F, 2);
    void *dy = dev_random((size_t)R * H, 2), *dgu = dev_random((size_t)R * 2 * F, 2);
    void *w_gu = dev_random(wgu, 2), *w_d = dev_random(wd, 2);
    const float *dw0[2] = {dev_random(wgu, 4), dev_random(wd, 4)};
    struct gemm g[6] = {
        {"fwd gate_up", FWD, H, 2 * F, x, w_gu, {NULL, NULL}},
        {"fwd down", FWD, F, H, act, w_d, {NULL, NULL}},
        {"dgrad down", DGRAD, F, H, dy, w_d, {NULL, NULL}},
        {"wgrad down", WGRAD, F, H, dy, act, {NULL, NULL}},
        {"dgrad gate_up", DGRAD, H, 2 * F, dgu, w_gu, {NULL, NULL}},
        {"wgrad gate_up", WGRAD, H, 2 * F, dgu, x, {NULL, NULL}},
    };
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 2; j++) g[i].out[j] = dev_alloc(out_elems(&g[i]) * (g[i].kind == WGRAD ? 4 : 2));

    struct cudaDeviceProp prop;
    CUDA_CALL(cudaGetDeviceProperties(&prop, 0));
    if (reps == 0) printf("bench_grouped_gemm: %s, %d SMs; one launch of each (profile)\n", prop.name,
                          prop.multiProcessorCount);
    else printf("bench_grouped_gemm: %s, %d SMs; median of %d runs after %d warm-ups\n", prop.name,
                prop.multiProcessorCount, reps, WARM);

    int bal[E], skew[E];
    double wsum = 0.0, wt[E];
    for (int e = 0; e < E; e++) bal[e] = R / E;
    for (int e = 0; e < E; e++) wsum += wt[e] = 1.0 / pow(e + 1, 0.8);
    int s = 0;
    for (int e = 0; e < E; e++) s += skew[e] = (int)(R * wt[e] / wsum);
    skew[0] += R - s;
    if (reps == 0) {
        /* the Zipf-like counts in whole 128-row blocks (at least one an expert, the first expert
         * taking up the difference): what skew costs without the experts' partly empty blocks */
        int skew128[E], s128 = 0;
        for (int e = 0; e < E; e++) s128 += skew128[e] = MT_MAX(1, (skew[e] + 64) / 128) * 128;
        skew128[0] += R - s128;
        profile_once("balanced", bal, g, 6);
        profile_once("skewed", skew, g, 6);
        profile_once("skewed-128", skew128, g, 6);
    } else {
        bench("balanced", bal, g, 6, dw0, reps);
        bench("skewed (Zipf-like)", skew, g, 6, dw0, reps);
        bench_groups("balanced", bal, g, 6, reps);
        bench_groups("skewed (Zipf-like)", skew, g, 6, reps);
    }

    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 2; j++) CUDA_CALL(cudaFree(g[i].out[j]));
    void *bufs[] = {x, act, dy, dgu, w_gu, w_d, (void *)dw0[0], (void *)dw0[1], src_bf16, src_f32};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) CUDA_CALL(cudaFree(bufs[i]));
    CB(cublasDestroy(blas));
    return 0;
}
#endif

int main(int argc, char **argv)
{
    int reps = 20;
    if (argc > 1) {
        char *end;
        const long v = strtol(argv[1], &end, 10);
        if (*end || v < 0 || v > 10000) {
            fprintf(stderr, "bench_grouped_gemm: repeats must be an integer in 0..10000, got '%s'\n",
                    argv[1]);
            return 2;
        }
        reps = (int)v;
    }
#ifdef MT_HAVE_CUDA
    return run_bench(reps);
#else
    (void)reps;
    printf("bench_grouped_gemm: built without CUDA; nothing to measure\n");
    return 0;
#endif
}
