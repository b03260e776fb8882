/* Grouped bf16 expert GEMMs for Hopper (sm_90a): one persistent launch per GEMM covers every
 * expert, through TMA loads into a 4-stage shared-memory pipeline and wgmma with fp32 accumulation
 * (grouped_gemm.cu says how). Same contract as ops.h's expert_matmul: rows [off[e], off[e+1]) of
 * the row matrices belong to expert e; off is DEVICE memory (n_exp + 1 int64, non-decreasing,
 * off[0] >= 0, off[n_exp] <= rows: the route plan's, trusted) and rows is how many rows the row
 * matrices hold; the host never reads the offsets, so a call queues its work without waiting.
 * Experts with no rows are skipped entirely (their dw is not touched, except that an overwriting
 * wgrad zeroes it).
 *
 * Each call returns false, having done nothing, when the shapes or pointers are outside what the
 * kernel handles (I or O not a positive multiple of 8, a pointer not 16-byte aligned, rows more
 * than 2^31 - 1, a device that is not sm_90 or MT_FORCE_SM80=1): the caller then takes its cuBLAS
 * path.
 *
 * Plain C declarations so that C tools (tools/bench_grouped_gemm.c) can call them too. */
#ifndef MT_GROUPED_GEMM_CUH
#define MT_GROUPED_GEMM_CUH

#include <stdbool.h>
#include <stdint.h>

#include "ops.h" /* struct expert_rows */

#ifdef __cplusplus
extern "C" {
#endif

/* out[r] = in[r] · W[e]ᵀ for r in expert e's rows; end (device [n_exp], or NULL): expert e's rows
 * are [off[e], end[e]) instead, off[e] <= end[e] (part of each expert's rows; the others are
 * neither read into any output row nor written) */
bool grouped_gemm_forward(void *out /*[rows,O] bf16*/, const void *in /*[rows,I] bf16*/,
                          const void *w /*[n_exp,O,I] bf16*/, const int64_t *off /*[n_exp+1]*/,
                          const int64_t *end /*[n_exp] or NULL*/, int64_t rows, int n_exp, int I, int O);

/* din[r] = dout[r] · W[e] (overwritten) */
bool grouped_gemm_dgrad(void *din /*[rows,I] bf16*/, const void *dout /*[rows,O] bf16*/,
                        const void *w /*[n_exp,O,I] bf16*/, const int64_t *off /*[n_exp+1]*/,
                        int64_t rows, int n_exp, int I, int O);

/* dw[e] += dout[rows of e]ᵀ · in[rows of e] (fp32 accumulate); overwrite: dw[e] = that product,
 * zeros for experts with no rows (dw is not read: the same bits as zeroing dw first) */
bool grouped_gemm_wgrad(float *dw /*[n_exp,O,I] fp32*/, const void *dout /*[rows,O] bf16*/,
                        const void *in /*[rows,I] bf16*/, const int64_t *off /*[n_exp+1]*/,
                        int64_t rows, int n_exp, int I, int O, bool overwrite);

/* The same over n_sets (1 .. MT_WGRAD_MAX_SETS) row sets in one pass (ops.h struct expert_rows:
 * several micro-steps' rows): dw[e] (+)= Σ_s dout_s[rows of e]ᵀ · in_s[rows of e], one fp32
 * accumulation per dw element (K walks the sets' rows in order), so dw is read and written once
 * for all of them. Sets with no rows are passed over. sumsq (device [1], or NULL): Σ dw² over all
 * of dw after the call, in double in an order fixed by the shapes. Overwriting, each tile's sum
 * is taken from its accumulators (the values it writes) and the tiles' sums added in tile order;
 * adding, dw's final values are not in the kernel, so a pass over dw follows the call. */
bool grouped_gemm_wgrad_sets(float *dw /*[n_exp,O,I] fp32*/, const struct expert_rows *sets,
                             int n_sets, int n_exp, int I, int O, bool overwrite, double *sumsq);

/* grouped_gemm_wgrad_sets in parts, for the waits of an exchange: each call takes tiles from
 * `cursor` (device, 2 int32 zeroed before the first part; the same sets, dw and overwrite in every
 * part) and leaves the rest to the next; until (ops.h): the tiles taken while that exchange is in
 * flight (none where until->flags is NULL), NULL: every tile left. Each tile adds its sum to dw
 * once, whichever part takes it, so the parts make the bits of one grouped_gemm_wgrad_sets. False
 * (nothing done) where grouped_gemm_wgrad_sets would decline, or past MAX_EXPERTS (256) experts. */
bool grouped_gemm_wgrad_part(float *dw /*[n_exp,O,I] fp32*/, const struct expert_rows *sets, int n_sets,
                             int n_exp, int I, int O, bool overwrite, int32_t *cursor /*[2] device*/,
                             const struct exchange_arrival *until);

/* Whether the kernel runs here: the backend is up on a compute capability 9.0 device and
 * MT_FORCE_SM80 is not set (the backend's g_cuda.hopper). When false, every call above declines. */
bool grouped_gemm_available(void);

/* The backend's stream (a cudaStream_t), for callers that time or order work around these. */
void *grouped_gemm_stream(void);

#ifdef __cplusplus
}
#endif

#endif
