/* Micro-benchmark of causal GQA attention in bf16: the tensor-core kernels (cuda/attention_tc.cu,
 * each forward tiling) against the fp32 CUDA-core kernels of cuda/attention.cu, at Qwen3-30B-A3B
 * shapes by default (B=2, S=4096, Hq=32, Hkv=4, D=128).
 *
 *   bench_attention [reps [B S Hq Hkv D]]   (default 20 timed repeats of the tensor-core kernels,
 *                                            3 of the CUDA-core ones, after warm-up; medians)
 *   bench_attention 0 [B S Hq Hkv D]        one tensor-core forward and backward, nothing else
 *                                            (for a profiler: ncu -k regex:tc_ ...)
 *
 * FLOPs counted as for causal attention: forward 2·2·B·Hq·D·S²/2 (Q·Kᵀ and P·V over the lower
 * triangle), backward 2.5× that (the usual convention; the kernels do more: dQ recomputes S, dP).
 * Inputs are random bf16 in [-1, 1) (never zeros). Before timing, the new kernels' outputs are
 * compared with the old ones at the benchmarked shape (each forward kernel: mma.sync 0-2, wgmma 3-6, TMA + wgmma 7-11) (‖new − old‖ / ‖old‖; lse max |diff|).
 * Then every backward kernel choice (attention_tc_set_bwd_variant: dK/dV kernel + 2 × dQ kernel,
 * and ATTN_BWD_DS: the 5-product passes with dS stored between them)
 * is compared with the mma.sync pair (variant 0), run twice (the FNV-1a hash of dq, dk, dv must
 * not change) and timed; the default's hashes (the forward's out and lse, the backward's dq, dk,
 * dv) are printed last, to compare between processes.
 * Timing uses CUDA events on the backend's stream. Without CUDA (or a GPU) it says so, exits 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "common.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include <cuda_runtime.h>

#include "../cuda/attention_tc.cuh"

enum { N_FWD = 12 }; /* forward kernels: attention_tc_set_variant 0..11 */

static int B = 2, S = 4096, Hq = 32, Hkv = 4, D = 128;
static cudaStream_t stream;
static void *q, *k, *v, *dout, *out, *dq, *dk, *dv;
static float *lse;

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a device bf16 tensor of n random values in [-1, 1) */
static void *dev_random(size_t n, uint64_t *state)
{
    uint16_t *h = mt_malloc(n * sizeof *h);
    uint64_t x = *state;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift64 */
        float f = (float)((double)(x >> 11) * (2.0 / 9007199254740992.0) - 1.0);
        if (f == 0.0f) f = 0.5f;
        h[i] = to_bf16(f);
    }
    *state = x;
    void *d;
    CUDA_CALL(cudaMalloc(&d, n * 2));
    CUDA_CALL(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    CUDA_CALL(cudaDeviceSynchronize());
    free(h);
    return d;
}

/* NaN bytes over a device buffer, ordered on the backend's stream (a non-blocking stream: plain
 * cudaMemset / cudaMemcpy on the legacy stream are not ordered with it) */
static void poison(void *d, size_t bytes)
{
    CUDA_CALL(cudaMemsetAsync(d, 0xff, bytes, stream));
    CUDA_CALL(cudaStreamSynchronize(stream));
}

static void *dev_alloc(size_t bytes)
{
    void *d;
    CUDA_CALL(cudaMalloc(&d, bytes));
    poison(d, bytes);
    return d;
}

static float *host_bf16(const void *d, size_t n)
{
    uint16_t *h = mt_malloc(n * sizeof *h);
    CUDA_CALL(cudaStreamSynchronize(stream));
    CUDA_CALL(cudaMemcpy(h, d, n * 2, cudaMemcpyDeviceToHost));
    float *f = mt_malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = from_bf16(h[i]);
    free(h);
    return f;
}

static double rel_err(const float *a, const float *ref, size_t n)
{
    double d = 0.0, r = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        d += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        r += (double)ref[i] * ref[i];
    }
    return r > 0.0 ? sqrt(d / r) : sqrt(d);
}

/* FNV-1a over the raw bytes of the device buffers bufs[i] of n[i] bytes */
static uint64_t buffers_hash(void *const *bufs, const size_t *n, int count)
{
    uint64_t h = 0xcbf29ce484222325ull;
    CUDA_CALL(cudaStreamSynchronize(stream));
    for (int i = 0; i < count; i++) {
        unsigned char *b = mt_malloc(n[i]);
        CUDA_CALL(cudaMemcpy(b, bufs[i], n[i], cudaMemcpyDeviceToHost));
        for (size_t j = 0; j < n[i]; j++) h = (h ^ b[j]) * 0x100000001b3ull;
        free(b);
    }
    return h;
}

static uint64_t grads_hash(void)
{
    const size_t n[3] = {(size_t)B * S * Hq * D * 2, (size_t)B * S * Hkv * D * 2, (size_t)B * S * Hkv * D * 2};
    void *const bufs[3] = {dq, dk, dv};
    return buffers_hash(bufs, n, 3);
}

/* the forward's out and lse */
static uint64_t forward_hash(void)
{
    const size_t n[2] = {(size_t)B * S * Hq * D * 2, (size_t)B * Hq * S * 4};
    void *const bufs[2] = {out, lse};
    return buffers_hash(bufs, n, 2);
}

enum { OP_FWD_TC, OP_BWD_TC, OP_FWD_SIMT, OP_BWD_SIMT };

static void run_op(int op)
{
    switch (op) {
    case OP_FWD_TC:
        if (!attention_tc_forward(out, lse, q, k, v, B, S, Hq, Hkv, D))
            mt_fatal("attention_tc_forward declined B=%d S=%d Hq=%d Hkv=%d D=%d", B, S, Hq, Hkv, D);
        break;
    case OP_BWD_TC:
        if (!attention_tc_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D))
            mt_fatal("attention_tc_backward declined");
        break;
    case OP_FWD_SIMT: attention_simt_forward(out, lse, q, k, v, B, S, Hq, Hkv, D); break;
    default: attention_simt_backward(dq, dk, dv, dout, q, k, v, out, lse, B, S, Hq, Hkv, D); break;
    }
}

/* median milliseconds of `reps` runs after `warm` untimed ones */
static double time_op(int op, int warm, int reps)
{
    for (int i = 0; i < warm; i++) run_op(op);
    CUDA_CALL(cudaStreamSynchronize(stream));
    cudaEvent_t e0, e1;
    CUDA_CALL(cudaEventCreate(&e0));
    CUDA_CALL(cudaEventCreate(&e1));
    float *ms = mt_malloc((size_t)reps * sizeof *ms);
    for (int i = 0; i < reps; i++) {
        CUDA_CALL(cudaEventRecord(e0, stream));
        run_op(op);
        CUDA_CALL(cudaEventRecord(e1, stream));
        CUDA_CALL(cudaEventSynchronize(e1));
        CUDA_CALL(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    CUDA_CALL(cudaGetLastError());
    bench_sort_floats(ms, reps);
    const double med = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
    const double lo = ms[0], hi = ms[reps - 1];
    free(ms);
    CUDA_CALL(cudaEventDestroy(e0));
    CUDA_CALL(cudaEventDestroy(e1));
    fprintf(stderr, "  op %d: median %.3f ms (min %.3f, max %.3f, %d reps)\n", op, med, lo, hi, reps);
    return med;
}

/* new vs old outputs at the benchmarked shape (fwd: each variant; bwd from the same out/lse) */
static void compare(void)
{
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    float *lse_h = mt_malloc(nl * sizeof *lse_h), *lse_o = mt_malloc(nl * sizeof *lse_o);
    run_op(OP_FWD_SIMT);
    float *o_old = host_bf16(out, nq);
    CUDA_CALL(cudaStreamSynchronize(stream));
    CUDA_CALL(cudaMemcpy(lse_o, lse, nl * 4, cudaMemcpyDeviceToHost));
    for (int var = 0; var < N_FWD; var++) {
        attention_tc_set_variant(var);
        poison(out, nq * 2);
        poison(lse, nl * 4);
        run_op(OP_FWD_TC);
        float *o_new = host_bf16(out, nq);
        CUDA_CALL(cudaStreamSynchronize(stream));
        CUDA_CALL(cudaMemcpy(lse_h, lse, nl * 4, cudaMemcpyDeviceToHost));
        double le = 0.0;
        for (size_t i = 0; i < nl; i++) le = isfinite(lse_h[i]) ? fmax(le, fabs(lse_h[i] - lse_o[i])) : INFINITY;
        printf("check fwd variant %d: out rel err %.2e, lse max abs err %.2e, out/lse hash %016llx\n", var,
               rel_err(o_new, o_old, nq), le, (unsigned long long)forward_hash());
        free(o_new);
    }
    attention_tc_set_variant(-1);
    /* both backwards from the same out/lse: the default tensor-core forward's */
    run_op(OP_FWD_TC);
    run_op(OP_BWD_SIMT);
    float *g_old[3] = {host_bf16(dq, nq), host_bf16(dk, nk), host_bf16(dv, nk)};
    poison(dq, nq * 2);
    poison(dk, nk * 2);
    poison(dv, nk * 2);
    run_op(OP_BWD_TC);
    float *g_new[3] = {host_bf16(dq, nq), host_bf16(dk, nk), host_bf16(dv, nk)};
    const size_t n[3] = {nq, nk, nk};
    for (int i = 0; i < 3; i++) {
        printf("check bwd d%c: rel err %.2e\n", "qkv"[i], rel_err(g_new[i], g_old[i], n[i]));
        free(g_old[i]), free(g_new[i]);
    }
    free(o_old), free(lse_h), free(lse_o);
}

/* Each backward kernel choice against the mma.sync pair on the same out/lse (the default
 * forward's), its rerun hash, and its median time. */
static void bwd_variants(int reps, double bwd_flop)
{
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D;
    const size_t n[3] = {nq, nk, nk};
    void *const bufs[3] = {dq, dk, dv};
    const int dflt = attention_tc_set_bwd_variant(0);
    run_op(OP_FWD_TC);
    run_op(OP_BWD_TC);
    float *ref[3] = {host_bf16(dq, nq), host_bf16(dk, nk), host_bf16(dv, nk)};
    printf("\n%-24s %8s %8s %9s %9s %9s  %-16s\n", "bwd variant (dkdv+2*dq)", "ms", "TFLOPS",
           "dq err", "dk err", "dv err", "hash");
    for (int var = 0; var < ATTN_BWD_VARIANTS; var++) {
        attention_tc_set_bwd_variant(var);
        for (int i = 0; i < 3; i++) poison(bufs[i], n[i] * 2);
        run_op(OP_BWD_TC);
        double err[3];
        for (int i = 0; i < 3; i++) {
            float *g = host_bf16(bufs[i], n[i]);
            err[i] = rel_err(g, ref[i], n[i]);
            free(g);
        }
        const uint64_t h1 = grads_hash();
        for (int i = 0; i < 3; i++) poison(bufs[i], n[i] * 2);
        run_op(OP_BWD_TC);
        const uint64_t h2 = grads_hash();
        const double ms = time_op(OP_BWD_TC, 3, reps);
        char name[32];
        if (var == ATTN_BWD_DS)
            snprintf(name, sizeof name, "%d (dS stored)%s", var, var == dflt ? " dflt" : "");
        else
            snprintf(name, sizeof name, "%d (%d + %d*%d)%s", var, var % ATTN_BWD_KINDS, ATTN_BWD_KINDS,
                     var / ATTN_BWD_KINDS, var == dflt ? " dflt" : "");
        printf("%-24s %8.3f %8.1f %9.2e %9.2e %9.2e  %016llx%s\n", name, ms,
               bwd_flop / (ms * 1e-3) / 1e12, err[0], err[1], err[2], (unsigned long long)h1,
               h1 == h2 ? "" : " RERUN DIFFERS");
    }
    attention_tc_set_bwd_variant(dflt);
    for (int i = 0; i < 3; i++) free(ref[i]);
}

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : 20;
    if (argc > 6) B = atoi(argv[2]), S = atoi(argv[3]), Hq = atoi(argv[4]), Hkv = atoi(argv[5]), D = atoi(argv[6]);
    if (reps < 0 || B < 1 || S < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv || (D != 64 && D != 128)) {
        fprintf(stderr, "usage: bench_attention [reps [B S Hq Hkv D]] (D 64 or 128, Hkv | Hq)\n");
        return 2;
    }
    if (!backend_cuda(false, 0)) {
        printf("bench_attention: no CUDA device, nothing to time\n");
        return 0;
    }
    stream = (cudaStream_t)attention_tc_stream();
    const size_t nq = (size_t)B * S * Hq * D, nk = (size_t)B * S * Hkv * D, nl = (size_t)B * Hq * S;
    uint64_t st = 0x9e3779b97f4a7c15ull;
    q = dev_random(nq, &st), k = dev_random(nk, &st), v = dev_random(nk, &st);
    dout = dev_random(nq, &st);
    out = dev_alloc(nq * 2), dq = dev_alloc(nq * 2), dk = dev_alloc(nk * 2), dv = dev_alloc(nk * 2);
    lse = dev_alloc(nl * 4);

    struct cudaDeviceProp prop;
    CUDA_CALL(cudaGetDeviceProperties(&prop, 0));
    if (reps == 0) {
        run_op(OP_FWD_TC);
        run_op(OP_BWD_TC);
        CUDA_CALL(cudaStreamSynchronize(stream));
        CUDA_CALL(cudaGetLastError());
        printf("bench_attention: one forward and backward done\n");
        return 0;
    }
    printf("bench_attention on %s: B=%d S=%d Hq=%d Hkv=%d D=%d causal bf16\n", prop.name, B, S, Hq,
           Hkv, D);
    compare();

    const double fwd_flop = 2.0 * 2.0 * B * Hq * (double)D * S * (double)S / 2.0;
    const double bwd_flop = 2.5 * fwd_flop;
    double t_fwd[N_FWD];
    for (int var = 0; var < N_FWD; var++) {
        attention_tc_set_variant(var);
        t_fwd[var] = time_op(OP_FWD_TC, 3, reps);
    }
    attention_tc_set_variant(-1);
    run_op(OP_FWD_TC); /* out/lse for the backward */
    const double t_bwd = time_op(OP_BWD_TC, 3, reps);
    const int sreps = reps < 3 ? reps : 3;
    const double t_fwd_old = time_op(OP_FWD_SIMT, 1, sreps);
    run_op(OP_FWD_TC);
    const double t_bwd_old = time_op(OP_BWD_SIMT, 1, sreps);

    printf("\n%-34s %10s %10s\n", "kernel", "ms", "TFLOPS");
    for (int var = 0; var < N_FWD; var++) {
        char name[64];
        snprintf(name, sizeof name, "fwd %s (variant %d)", var < 3 ? "mma.sync" : var < 7 ? "wgmma" : "wgmma+TMA", var);
        printf("%-34s %10.3f %10.1f\n", name, t_fwd[var], fwd_flop / (t_fwd[var] * 1e-3) / 1e12);
    }
    printf("%-34s %10.3f %10.1f\n", "bwd tensor-core", t_bwd, bwd_flop / (t_bwd * 1e-3) / 1e12);
    const double t_fwd_dflt = time_op(OP_FWD_TC, 3, reps); /* the default kernel (variant -1) */
    printf("%-34s %10.3f %10.1f\n", "fwd default", t_fwd_dflt, fwd_flop / (t_fwd_dflt * 1e-3) / 1e12);
    printf("%-34s %10.3f %10.1f\n", "fwd + bwd, defaults", t_fwd_dflt + t_bwd,
           (fwd_flop + bwd_flop) / ((t_fwd_dflt + t_bwd) * 1e-3) / 1e12);
    printf("%-34s %10.3f %10.1f\n", "fwd fp32 CUDA cores (old)", t_fwd_old,
           fwd_flop / (t_fwd_old * 1e-3) / 1e12);
    printf("%-34s %10.3f %10.1f\n", "bwd fp32 CUDA cores (old)", t_bwd_old,
           bwd_flop / (t_bwd_old * 1e-3) / 1e12);

    bwd_variants(reps, bwd_flop);
    run_op(OP_FWD_TC);
    printf("fwd default variant: out/lse hash %016llx\n", (unsigned long long)forward_hash());
    run_op(OP_BWD_TC);
    printf("bwd default variant: dq/dk/dv hash %016llx\n", (unsigned long long)grads_hash());

    void *bufs[] = {q, k, v, dout, out, dq, dk, dv, lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CUDA_CALL(cudaFree(bufs[i]));
    return 0;
}

#else
int main(void)
{
    printf("bench_attention: built without CUDA, nothing to time\n");
    return 0;
}
#endif
