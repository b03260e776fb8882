/* Dense matmul on the CPU: every product is C = A Bᵀ over contiguous rows (cpu_gemm_nt); the
 * backward transposes its operands into scratch so that din and dw are the same kernel. */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_dot.h"
#include "common.h"

#include <stdlib.h>

/* Four rows of A against one row of B, each lane exactly as cpu_dot computes it, so that an
 * element's value does not depend on which rows share its block. */
static void dot4(float out[4], const float *a0, const float *a1, const float *a2, const float *a3,
                 const float *b, int K)
{
    cpu_v4f l0 = {0}, h0 = {0}, l1 = {0}, h1 = {0}, l2 = {0}, h2 = {0}, l3 = {0}, h3 = {0};
    int i = 0;
    for (; i + 8 <= K; i += 8) {
        cpu_v4f bl = cpu_load4(b + i), bh = cpu_load4(b + i + 4);
        l0 += cpu_load4(a0 + i) * bl;
        h0 += cpu_load4(a0 + i + 4) * bh;
        l1 += cpu_load4(a1 + i) * bl;
        h1 += cpu_load4(a1 + i + 4) * bh;
        l2 += cpu_load4(a2 + i) * bl;
        h2 += cpu_load4(a2 + i + 4) * bh;
        l3 += cpu_load4(a3 + i) * bl;
        h3 += cpu_load4(a3 + i + 4) * bh;
    }
    float r0 = cpu_hsum8(l0, h0), r1 = cpu_hsum8(l1, h1), r2 = cpu_hsum8(l2, h2),
          r3 = cpu_hsum8(l3, h3);
    for (; i < K; i++) {
        r0 += a0[i] * b[i];
        r1 += a1[i] * b[i];
        r2 += a2[i] * b[i];
        r3 += a3[i] * b[i];
    }
    out[0] = r0;
    out[1] = r1;
    out[2] = r2;
    out[3] = r3;
}

void cpu_gemm_nt(float *c, const float *a, const float *b, int M, int K, int N, bool accumulate)
{
    MT_CHECK(M >= 0 && K >= 0 && N >= 0, "cpu_gemm_nt: negative size M=%d K=%d N=%d", M, K, N);
    for (int m0 = 0; m0 < M; m0 += 4) {
        int nr = MT_MIN(4, M - m0);
        /* A short last block repeats its final row through the same 4-row kernel (results for the
         * repeats are discarded), so every row takes one code path. */
        const float *ar[4];
        for (int r = 0; r < 4; r++) ar[r] = a + (size_t)(m0 + MT_MIN(r, nr - 1)) * K;
        for (int n = 0; n < N; n++) {
            float d[4];
            dot4(d, ar[0], ar[1], ar[2], ar[3], b + (size_t)n * K, K);
            for (int r = 0; r < nr; r++) {
                float *cp = c + (size_t)(m0 + r) * N + n;
                *cp = accumulate ? *cp + d[r] : d[r];
            }
        }
    }
}

void cpu_transpose(float *out, const float *in, int R, int C)
{
    enum { TILE = 32 };
    for (int r0 = 0; r0 < R; r0 += TILE)
        for (int c0 = 0; c0 < C; c0 += TILE) {
            int r1 = MT_MIN(R, r0 + TILE), c1 = MT_MIN(C, c0 + TILE);
            for (int r = r0; r < r1; r++)
                for (int cc = c0; cc < c1; cc++) out[(size_t)cc * R + r] = in[(size_t)r * C + cc];
        }
}

void cpu_matmul_forward(float *out, const float *in, const float *w, int N, int I, int O)
{
    cpu_gemm_nt(out, in, w, N, I, O, false);
}

void cpu_matmul_backward(float *din, float *dw, const float *dout, const float *in, const float *w,
                         int N, int I, int O, bool accumulate)
{
    MT_CHECK(N >= 0 && I >= 0 && O >= 0, "cpu_matmul_backward: negative size N=%d I=%d O=%d", N,
             I, O);
    if (N == 0) return; /* no rows: nothing to write, and dw must stay bit-for-bit unchanged */
    if (din) {
        /* din[N,I] = dy[N,O] · W[O,I] = dy · (Wᵀ[I,O])ᵀ */
        float *wt = mt_malloc((size_t)I * O * sizeof(float));
        cpu_transpose(wt, w, O, I);
        cpu_gemm_nt(din, dout, wt, N, O, I, accumulate);
        free(wt);
    }
    if (dw) {
        /* dw[O,I] += dyᵀ[O,N] · x[N,I] = dyᵀ · (xᵀ[I,N])ᵀ, summed over N before the add */
        float *dyt = mt_malloc((size_t)O * N * sizeof(float));
        float *xt = mt_malloc((size_t)I * N * sizeof(float));
        cpu_transpose(dyt, dout, N, O);
        cpu_transpose(xt, in, N, I);
        cpu_gemm_nt(dw, dyt, xt, O, N, I, true);
        free(dyt);
        free(xt);
    }
}
