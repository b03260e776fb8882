/* Shared helpers of the GPU parity tests (suite "gpu": test_gpu_ops.c, test_gpu_attention.c,
 * test_gpu_moe.c): every op of the CUDA backend, forward and backward, against the fp32 CPU
 * reference (src/cpu/) on the same fresh random inputs, in both CUDA modes.
 *
 * Method. Inputs are drawn in fp32 on the host, uploaded and cast to the compute dtype on the
 * device, then cast back and downloaded, so the CPU reference sees exactly the (bf16-rounded)
 * values the GPU sees. Every GPU output buffer is poisoned with NaN bytes before the op runs, so an
 * element the op forgot to write fails the check (a NaN makes the error infinite). The measure is
 * ‖gpu − cpu‖ / ‖cpu‖ over the whole output (for accumulating outputs, over what the op added).
 *
 * Tolerances (each check prints its measured error to stderr):
 *  - TOL_F32 = 1e-5, fp32 mode. Both backends compute in fp32 with the same formulas; they differ
 *    only in summation order and in the last ulp of expf/sinf/cosf (CUDA's are within 2 ulp), so
 *    errors are a few ulp (~1e-7 … 1e-6). 1e-5 leaves an order of magnitude.
 *  - TOL_F32_LONG = 1e-4, fp32 mode, outputs that are long reductions of products whose terms
 *    cancel (attention backward: dP − Di, sums over every visible key and query), where the
 *    order-dependent rounding relative to a small result grows to ~1e-5.
 *  - TOL_BF16 = 1e-2, bf16 mode. bf16 keeps 8 significant bits, so one rounding of an output is a
 *    relative error up to 2^-9 ≈ 2e-3 (≈1.1e-3 rms); the GPU rounds at the points of spec §7
 *    (e.g. the RMSNorm value before the weight, cos/sin, SiLU) while the CPU stays in fp32, which
 *    puts the expected error at 1e-3 … 5e-3. 1e-2 is about 2^-7: any real bug (a wrong index, a
 *    missing term, a wrong scale) gives O(1).
 * Exact checks: gathers and copies move bits (error 0); top-k indices must match exactly (the
 * same inputs give the same fp32 probabilities up to an ulp, and ties, which bf16 inputs make
 * common, are broken toward the lower id by both); experts with no rows keep dw bit for bit.
 *
 * Without a CUDA device (backend_cuda returns NULL) every test reports itself skipped (mode_get);
 * with MT_REQUIRE_GPU=1 (scripts/test-gpu.sh) that is a failure instead. */
#ifndef MT_TESTS_GPU_OPS_UTIL_H
#define MT_TESTS_GPU_OPS_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "ops.h"

#define TOL_F32 1e-5
#define TOL_F32_LONG 1e-4
#define TOL_BF16 1e-2

struct mode {
    const struct backend *g; /* the CUDA backend of this mode */
    const struct backend *c; /* the CPU reference */
    const char *name;        /* "fp32" or "bf16" */
    double tol, tol_long;
};

/* mode 0 is fp32, mode 1 bf16 */
void mode_get(int i, struct mode *m);

/* ---------------------------------------------------------------- host helpers */

float *fnew(size_t n);

float *hrand(mt_rng *r, size_t n, double scale);

float *hdup(const float *x, size_t n);

int irand(mt_rng *r, int n);

void shuffle(mt_rng *r, int32_t *a, int n);

/* ‖got − ref‖ / ‖ref‖ (the plain norm of the difference if ref is zero); infinite if got holds a
 * NaN or an infinity */
double rel_err(const float *got, const float *ref, size_t n);

void check_close(const struct mode *m, const char *what, const float *got, const float *ref,
                 size_t n, double tol);

void check_exact(const struct mode *m, const char *what, const void *got, const void *ref,
                 size_t bytes);

/* a - b elementwise (what an accumulating op added) */
float *diff(const float *a, const float *b, size_t n);

/* ---------------------------------------------------------------- device helpers */

/* A device buffer of n compute-dtype elements holding h; h is overwritten with exactly the values
 * the device holds (rounded to bf16 in bf16 mode) so that the CPU reference uses the same input. */
void *dx_from(const struct mode *m, float *h, size_t n);

float *df_from(const struct mode *m, const float *h, size_t n);

int32_t *di_from(const struct mode *m, const int32_t *h, size_t n);

/* NaN bytes over a device output before the op under test runs */
void poison(const struct mode *m, void *d, size_t bytes);

void *dx_poisoned(const struct mode *m, size_t n);

float *df_poisoned(const struct mode *m, size_t n);

/* host fp32 copies of device results */
float *hx_of(const struct mode *m, const void *dx, size_t n);

float *hf_of(const struct mode *m, const float *d, size_t n);

#endif
