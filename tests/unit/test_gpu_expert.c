/* GPU parity tests (suite "gpu"), the expert GEMMs: expert_matmul forward and backward (cuBLAS
 * and the grouped Hopper kernel, incl. skewed and empty experts), the grouped weight gradient over
 * several row sets, and MT_FORCE_SM80 taking the sm_80 paths -- against the fp32 CPU reference
 * (src/cpu/) on the same fresh random inputs, in both CUDA modes. Method, tolerances and exact
 * checks: gpu_ops_util.h.
 *
 * Without a CUDA device (backend_cuda returns NULL) every test reports itself skipped; with
 * MT_REQUIRE_GPU=1 (scripts/test-gpu.sh) that is a failure instead. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "env_flag.h"
#include "gpu_ops_util.h"
#include "ops.h"

#ifdef MT_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <unistd.h>

#include "../../cuda/grouped_gemm.cuh"
#endif

/* ---------------------------------------------------------------- expert matmul */

/* expert offsets in the GPU backend's memory (ops.h: off is backend memory) */
static int64_t *doff_from(const struct mode *M, const int64_t *off, int n_exp)
{
    int64_t *d = M->g->alloc(((size_t)n_exp + 1) * sizeof *d);
    M->g->upload(d, off, ((size_t)n_exp + 1) * sizeof *d);
    return d;
}

Test(gpu, expert_matmul)
{
    mt_rng rng;
    mt_rng_seed(&rng, 111);
    enum { NE = 6, I = 256, O = 192 };
    const int rows[NE] = {40, 0, 17, 64, 0, 35}; /* experts 1 and 4 get no rows */
    int64_t off[NE + 1] = {0};
    for (int e = 0; e < NE; e++) off[e + 1] = off[e] + rows[e];
    const int R = (int)off[NE];
    const size_t ri = (size_t)R * I, ro = (size_t)R * O, wn = (size_t)NE * O * I;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        float *in = hrand(&rng, ri, 1.0), *w = hrand(&rng, wn, 0.05), *dout = hrand(&rng, ro, 1.0);
        void *d_in = dx_from(&M, in, ri), *d_w = dx_from(&M, w, wn), *d_dout = dx_from(&M, dout, ro);

        int64_t *d_off = doff_from(&M, off, NE);
        void *d_out = dx_poisoned(&M, ro);
        M.g->expert_matmul_forward(d_out, d_in, d_w, d_off, NULL, R, NE, I, O);
        float *out = hx_of(&M, d_out, ro), *ref = fnew(ro);
        M.c->expert_matmul_forward(ref, in, w, off, NULL, R, NE, I, O);
        check_close(&M, "expert_matmul forward", out, ref, ro, M.tol);

        float *dw0 = hrand(&rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
        float *d_dw = df_from(&M, dw0, wn);
        void *d_din = dx_poisoned(&M, ri);
        M.g->expert_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
        float *din = hx_of(&M, d_din, ri), *dw = hf_of(&M, d_dw, wn), *din_ref = fnew(ri);
        M.c->expert_matmul_backward(din_ref, dw_ref, dout, in, w, off, R, NE, I, O, false);
        check_close(&M, "expert_matmul backward din", din, din_ref, ri, M.tol);
        float *add = diff(dw, dw0, wn), *add_ref = diff(dw_ref, dw0, wn);
        check_close(&M, "expert_matmul backward dw (added)", add, add_ref, wn, M.tol);
        for (int e = 0; e < NE; e++)
            if (rows[e] == 0) {
                const size_t o = (size_t)e * O * I;
                check_exact(&M, "expert_matmul empty expert keeps dw", dw + o, dw0 + o,
                            (size_t)O * I * sizeof(float));
            }

        M.g->free(d_in), M.g->free(d_w), M.g->free(d_dout), M.g->free(d_out), M.g->free(d_dw);
        M.g->free(d_din), M.g->free(d_off);
        free(in), free(w), free(dout), free(out), free(ref), free(dw0), free(dw_ref), free(din);
        free(dw), free(din_ref), free(add), free(add_ref);
    }
}

/* One source rank's rows of each expert (ops.h moe_rows_split) and the forward over part of each
 * expert's rows (expert_matmul_forward's end), as moe.c's combine_self_last runs them: 3 source
 * ranks of 100 pairs, each expert's rows in ascending pair order with a random share from each
 * (ragged tile edges: 0, 1, 127, 129 rows and more). The split must equal the CPU's exactly; the
 * rows of the ranks before, then after, then the middle rank's must each come out as the whole
 * forward's (CPU reference, mode tolerance) with every row outside the call's part left poisoned;
 * where the grouped kernel runs (bf16 on Hopper), the three parts give the one-piece forward's bits. */
Test(gpu, expert_matmul_part_rows)
{
    mt_rng rng;
    mt_rng_seed(&rng, 117);
    enum { NE = 6, I = 256, O = 192, SRC = 3, PER = 100 };
    const int rows[NE] = {300, 0, 129, 1, 260, 127};
    int64_t off[NE + 1] = {0};
    for (int e = 0; e < NE; e++) off[e + 1] = off[e] + rows[e];
    const int R = (int)off[NE];
    int32_t *src = mt_calloc((size_t)R, sizeof *src);
    for (int e = 0; e < NE; e++) { /* ascending pair indices: a sorted draw from the 300 pairs */
        int r = (int)off[e];
        for (int p = 0; p < SRC * PER && r < off[e + 1]; p++) {
            const int left = SRC * PER - p, need = (int)(off[e + 1] - r);
            if (irand(&rng, left) < need) src[r++] = p;
        }
        if (e == 2) /* none from rank 0: its own part starts at the expert's first row */
            for (int k = 0; k < rows[e]; k++) src[off[e] + k] = k < PER ? PER + k : 2 * PER + k - PER;
    }
    const size_t ri = (size_t)R * I, ro = (size_t)R * O, wn = (size_t)NE * O * I;
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        char what[160];
        int64_t lo[NE + 1], hi[NE + 1], glo[NE + 1], ghi[NE + 1];
        M.c->moe_rows_split(lo, hi, off, src, NE, PER, 2 * PER);
        int64_t *d_off = doff_from(&M, off, NE);
        int64_t *d_split = M.g->alloc(2 * (NE + 1) * sizeof(int64_t)), *d_lo = d_split, *d_hi = d_split + NE + 1;
        int32_t *d_src = di_from(&M, src, (size_t)R);
        M.g->moe_rows_split(d_lo, d_hi, d_off, d_src, NE, PER, 2 * PER);
        M.g->download(glo, d_lo, sizeof glo);
        M.g->download(ghi, d_hi, sizeof ghi);
        check_exact(&M, "moe_rows_split lo", glo, lo, sizeof lo);
        check_exact(&M, "moe_rows_split hi", ghi, hi, sizeof hi);
        for (int e = 0; e < NE; e++) /* the CPU's split, by a scan */
            for (int64_t r = off[e]; r < off[e + 1]; r++) {
                const bool mine = src[r] >= PER && src[r] < 2 * PER;
                cr_expect(mine == (r >= lo[e] && r < hi[e]), "%s: row %lld of expert %d (pair %d) split wrong",
                          M.name, (long long)r, e, (int)src[r]);
            }

        float *in = hrand(&rng, ri, 1.0), *w = hrand(&rng, wn, 0.05);
        void *d_in = dx_from(&M, in, ri), *d_w = dx_from(&M, w, wn);
        float *ref = fnew(ro);
        M.c->expert_matmul_forward(ref, in, w, off, NULL, R, NE, I, O);
        void *d_whole = dx_poisoned(&M, ro), *d_out = dx_poisoned(&M, ro);
        M.g->expert_matmul_forward(d_whole, d_in, d_w, d_off, NULL, R, NE, I, O);
        /* the parts in moe.c's order: [off, lo), [hi, off + 1), [lo, hi) */
        const int64_t *begin[3] = {d_off, d_hi, d_lo}, *end[3] = {d_lo, d_off + 1, d_hi};
        const int64_t *hb[3] = {off, hi, lo}, *he[3] = {lo, off + 1, hi};
        const char *name[3] = {"before", "after", "own"};
        bool *done = mt_calloc((size_t)R, sizeof *done);
        for (int k = 0; k < 3; k++) {
            M.g->expert_matmul_forward(d_out, d_in, d_w, begin[k], end[k], R, NE, I, O);
            for (int e = 0; e < NE; e++)
                for (int64_t r = hb[k][e]; r < he[k][e]; r++) done[r] = true;
            float *out = hx_of(&M, d_out, ro);
            bool kept = true;
            for (int64_t r = 0; r < R; r++) {
                if (done[r]) continue;
                for (int o = 0; o < O; o++) kept = kept && isnan(out[r * O + o]);
            }
            snprintf(what, sizeof what, "expert_matmul part %s leaves the other rows alone", name[k]);
            cr_expect(kept, "%s: %s", M.name, what);
            free(out);
        }
        float *out = hx_of(&M, d_out, ro);
        check_close(&M, "expert_matmul in three parts", out, ref, ro, M.tol);
#ifdef MT_HAVE_CUDA
        if (M.g->x_size == 2 && grouped_gemm_available()) {
            float *whole = hx_of(&M, d_whole, ro);
            check_exact(&M, "grouped forward in parts = in one piece", out, whole, ro * sizeof(float));
            free(whole);
        }
#endif
        M.g->free(d_in), M.g->free(d_w), M.g->free(d_whole), M.g->free(d_out), M.g->free(d_off);
        M.g->free(d_split), M.g->free(d_src);
        free(in), free(w), free(ref), free(out), free(done);
    }
    free(src);
}

/* The grouped Hopper kernel behind the bf16 expert_matmul (cuda/grouped_gemm.cu), case by case:
 * every output is checked per expert, so a tile that reads or writes a neighbour's rows (the
 * ragged edges: 0, 1, 127, 129 rows; the wgrad K loop stopping at the expert's end) shows even
 * when the neighbour is much larger. w_off shifts the weights off 16-byte alignment, which the
 * kernel does not take for forward and dgrad (cuBLAS does the work then). In bf16 mode the
 * kernel is also called directly: it must accept exactly the cases `kernel` (forward, dgrad) and
 * `kernel_wgrad` say, and give the same bits as the backend op (the same deterministic kernel).
 * dw tolerance: fp32 sums of exact products of bf16 values, differing from the CPU only in
 * order, ~1e-6; 1e-4 in both modes. */
static void grouped_case(const struct mode *M, mt_rng *rng, const char *tag, int NE, const int *rows,
                         int I, int O, int w_off, bool kernel, bool kernel_wgrad)
{
    char what[128];
    int64_t *off = mt_calloc((size_t)NE + 1, sizeof *off);
    for (int e = 0; e < NE; e++) off[e + 1] = off[e] + rows[e];
    const int R = (int)off[NE];
    const size_t ri = (size_t)R * I, ro = (size_t)R * O, wn = (size_t)NE * O * I;
    const size_t xs = M->g->x_size;
    float *in = hrand(rng, ri, 1.0), *wfull = hrand(rng, wn + w_off, 0.05), *dout = hrand(rng, ro, 1.0);
    void *d_in = dx_from(M, in, ri), *d_dout = dx_from(M, dout, ro);
    void *d_wfull = dx_from(M, wfull, wn + w_off);
    const float *w = wfull + w_off;
    const void *d_w = (const char *)d_wfull + (size_t)w_off * xs;

    int64_t *d_off = doff_from(M, off, NE);

    /* forward */
    void *d_out = dx_poisoned(M, ro);
    M->g->expert_matmul_forward(d_out, d_in, d_w, d_off, NULL, R, NE, I, O);
    float *out = hx_of(M, d_out, ro), *ref = fnew(ro);
    M->c->expert_matmul_forward(ref, in, w, off, NULL, R, NE, I, O);

    /* backward: din overwritten, dw accumulated onto random values */
    float *dw0 = hrand(rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
    float *d_dw = df_from(M, dw0, wn);
    void *d_din = dx_poisoned(M, ri);
    M->g->expert_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
    float *din = hx_of(M, d_din, ri), *dw = hf_of(M, d_dw, wn), *din_ref = fnew(ri);
    M->c->expert_matmul_backward(din_ref, dw_ref, dout, in, w, off, R, NE, I, O, false);
    float *add = diff(dw, dw0, wn), *add_ref = diff(dw_ref, dw0, wn);

    double e_out = 0.0, e_din = 0.0, e_dw = 0.0;
    bool empty_kept = true;
    for (int e = 0; e < NE; e++) {
        const size_t oi = (size_t)e * O * I;
        if (rows[e] == 0) {
            empty_kept = empty_kept && memcmp(dw + oi, dw0 + oi, (size_t)O * I * sizeof(float)) == 0;
            continue;
        }
        const double a = rel_err(out + off[e] * O, ref + off[e] * O, (size_t)rows[e] * O);
        const double b = rel_err(din + off[e] * I, din_ref + off[e] * I, (size_t)rows[e] * I);
        const double c = rel_err(add + oi, add_ref + oi, (size_t)O * I);
        cr_expect(a <= M->tol && b <= M->tol && c <= TOL_F32_LONG,
                  "grouped %s [%s] expert %d (%d rows): rel err out %.2e din %.2e dw %.2e", tag,
                  M->name, e, rows[e], a, b, c);
        e_out = fmax(e_out, a), e_din = fmax(e_din, b), e_dw = fmax(e_dw, c);
    }
    fprintf(stderr, "gpu %s grouped %-36s worst expert: out %.2e din %.2e dw %.2e\n", M->name, tag,
            e_out, e_din, e_dw);
    snprintf(what, sizeof what, "grouped %s: empty experts keep dw", tag);
    fprintf(stderr, "gpu %s %-44s %s\n", M->name, what, empty_kept ? "bit-exact" : "DIFFERS");
    cr_expect(empty_kept, "%s [%s]", what, M->name);

    /* dw alone (din NULL): a second backward adds the same gradient again */
    M->g->expert_matmul_backward(NULL, d_dw, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
    float *dw2 = hf_of(M, d_dw, wn), *add2 = diff(dw2, dw, wn);
    snprintf(what, sizeof what, "grouped %s: dw += again (din NULL)", tag);
    check_close(M, what, add2, add_ref, wn, TOL_F32_LONG);
    float *din_again = hx_of(M, d_din, ri);
    snprintf(what, sizeof what, "grouped %s: din NULL leaves din", tag);
    check_exact(M, what, din_again, din, ri * sizeof(float));

    /* dw_overwrite into NaN: the same bits as adding onto zeros, zeros for experts with no rows */
    float *zeros = fnew(wn), *nans = fnew(wn);
    for (size_t i = 0; i < wn; i++) nans[i] = NAN;
    float *d_dwz = df_from(M, zeros, wn), *d_dwo = df_from(M, nans, wn);
    M->g->expert_matmul_backward(NULL, d_dwz, d_dout, d_in, d_w, d_off, R, NE, I, O, false);
    M->g->expert_matmul_backward(NULL, d_dwo, d_dout, d_in, d_w, d_off, R, NE, I, O, true);
    float *dwz = hf_of(M, d_dwz, wn), *dwo = hf_of(M, d_dwo, wn);
    snprintf(what, sizeof what, "grouped %s: dw overwrite = zeros + add", tag);
    check_exact(M, what, dwo, dwz, wn * sizeof(float));
    snprintf(what, sizeof what, "grouped %s: dw overwrite (vs CPU)", tag);
    check_close(M, what, dwo, add_ref, wn, TOL_F32_LONG);
    M->g->free(d_dwz), M->g->free(d_dwo);
    free(zeros), free(nans), free(dwz), free(dwo);

#ifdef MT_HAVE_CUDA
    if (xs == 2) {
        /* on the sm_80 path (not a 9.0 device, or MT_FORCE_SM80=1) the kernel declines them all */
        kernel = kernel && grouped_gemm_available();
        kernel_wgrad = kernel_wgrad && grouped_gemm_available();
        void *d_out2 = dx_poisoned(M, ro), *d_din2 = dx_poisoned(M, ri);
        float *d_dw2 = df_from(M, dw0, wn);
        const bool f = grouped_gemm_forward(d_out2, d_in, d_w, d_off, NULL, R, NE, I, O);
        const bool g = grouped_gemm_dgrad(d_din2, d_dout, d_w, d_off, R, NE, I, O);
        const bool h = grouped_gemm_wgrad(d_dw2, d_dout, d_in, d_off, R, NE, I, O, false);
        cr_expect(f == kernel && g == kernel && h == kernel_wgrad,
                  "grouped %s: kernel took fwd %d dgrad %d wgrad %d, expected %d %d %d", tag, f, g,
                  h, kernel, kernel, kernel_wgrad);
        if (kernel && kernel_wgrad) {
            float *out2 = hx_of(M, d_out2, ro), *din2 = hx_of(M, d_din2, ri), *dw3 = hf_of(M, d_dw2, wn);
            snprintf(what, sizeof what, "grouped %s: direct call = op (fwd)", tag);
            check_exact(M, what, out2, out, ro * sizeof(float));
            snprintf(what, sizeof what, "grouped %s: direct call = op (dgrad)", tag);
            check_exact(M, what, din2, din, ri * sizeof(float));
            snprintf(what, sizeof what, "grouped %s: direct call = op (wgrad)", tag);
            check_exact(M, what, dw3, dw, wn * sizeof(float));
            free(out2), free(din2), free(dw3);
        }
        M->g->free(d_out2), M->g->free(d_din2), M->g->free(d_dw2);
    }
#endif

    M->g->free(d_in), M->g->free(d_wfull), M->g->free(d_dout), M->g->free(d_out), M->g->free(d_dw);
    M->g->free(d_din), M->g->free(d_off);
    free(off), free(in), free(wfull), free(dout), free(out), free(ref), free(dw0), free(dw_ref);
    free(din), free(dw), free(din_ref), free(add), free(add_ref), free(dw2), free(add2), free(din_again);
}

Test(gpu, expert_matmul_grouped)
{
    mt_rng rng;
    mt_rng_seed(&rng, 115);
    /* tile edges: 128 rows per tile, 32 rows per wgrad K block, 256 columns per tile */
    const int edges[] = {0, 1, 127, 129, 300, 0, 64, 65};
    const int odd[] = {70, 0, 1, 200, 33};
    const int few[] = {5, 0, 40};
    enum { MANY = 300 }; /* more experts than the schedule kernel's threads take one each of */
    int many[MANY];
    for (int e = 0; e < MANY; e++) many[e] = irand(&rng, 5);
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        grouped_case(&M, &rng, "tile edges 256->512", 8, edges, 256, 512, 0, true, true);
        grouped_case(&M, &rng, "I, O not /64 (200->136)", 5, odd, 200, 136, 0, true, true);
        grouped_case(&M, &rng, "300 experts 64->72", MANY, many, 64, 72, 0, true, true);
        /* dw 904 x 1032 (ragged both ways), 40 wgrad tiles an expert, 240 in all: some CTAs run
         * two, so the ring's stages and phases carry over from one tile to the next */
        grouped_case(&M, &rng, "many tiles 1032->904", 8, edges, 1032, 904, 0, true, true);
        grouped_case(&M, &rng, "I, O not /8 (fallback)", 3, few, 100, 60, 0, false, false);
        {
            /* no rows at all (an EP rank nobody routed to): overwriting still zeroes every dw */
            enum { NE0 = 3, I0 = 64, O0 = 72 };
            const int64_t off0[NE0 + 1] = {0, 0, 0, 0};
            int64_t *d_off0 = doff_from(&M, off0, NE0);
            const size_t wn0 = (size_t)NE0 * O0 * I0;
            float *nans = fnew(wn0), *zeros = fnew(wn0);
            for (size_t k = 0; k < wn0; k++) nans[k] = NAN;
            float *d_dw0 = df_from(&M, nans, wn0);
            void *d_x0 = dx_poisoned(&M, (size_t)O0 * I0);
            M.g->expert_matmul_backward(NULL, d_dw0, d_x0, d_x0, d_x0, d_off0, 0, NE0, I0, O0, true);
            float *dw0 = hf_of(&M, d_dw0, wn0);
            check_exact(&M, "grouped, no rows: dw overwrite gives zeros", dw0, zeros, wn0 * sizeof(float));
            M.g->free(d_dw0), M.g->free(d_x0), M.g->free(d_off0);
            free(nans), free(zeros), free(dw0);
        }
        /* wgrad does not read w, so only forward and dgrad fall back */
        grouped_case(&M, &rng, "unaligned w (fallback)", 3, few, 64, 64, 1, false, true);
    }
}

/* NS row sets of random inputs and output gradients, rows[s][e] rows of expert e in set s: the
 * GPU's (g, in backend memory) and the CPU's (c, host) descriptions of the same values. Freed by
 * free_row_sets. */
struct row_sets {
    struct expert_rows g[MT_WGRAD_MAX_SETS], c[MT_WGRAD_MAX_SETS];
    int n;
};

static void make_row_sets(const struct mode *M, mt_rng *rng, int NE, int NS, const int *const *rows, int I, int O,
                          struct row_sets *rs)
{
    rs->n = NS;
    for (int k = 0; k < NS; k++) {
        int64_t *off = mt_calloc((size_t)NE + 1, sizeof *off);
        for (int e = 0; e < NE; e++) off[e + 1] = off[e] + rows[k][e];
        const size_t r = (size_t)off[NE];
        float *in = hrand(rng, MT_MAX(r, 1) * I, 1.0), *dout = hrand(rng, MT_MAX(r, 1) * O, 1.0);
        rs->g[k] = (struct expert_rows){dx_from(M, dout, MT_MAX(r, 1) * O), dx_from(M, in, MT_MAX(r, 1) * I),
                                        doff_from(M, off, NE), (int64_t)r};
        rs->c[k] = (struct expert_rows){dout, in, off, (int64_t)r};
    }
}

static void free_row_sets(const struct mode *M, struct row_sets *rs)
{
    for (int k = 0; k < rs->n; k++) {
        M->g->free((void *)rs->g[k].dout), M->g->free((void *)rs->g[k].in), M->g->free((void *)rs->g[k].off);
        free((void *)rs->c[k].dout), free((void *)rs->c[k].in), free((void *)rs->c[k].off);
    }
}

/* expert_matmul_wgrad_sets (several micro-steps' rows in one weight-gradient pass,
 * parallel.expert_wgrad_pairs / expert_wgrad_group) against the CPU's one backward add per set, per
 * expert: rows of some sets only, of all, of none (kept bit-exact when adding, zeros when
 * overwriting), ragged tile and K-block edges in each set, and whole sets empty. Tolerance
 * TOL_F32_LONG (fp32 sums of exact bf16 products, only the order differs). In bf16 mode on Hopper
 * the grouped kernel must take the call itself. Every call also returns Σ dw² after it (dw_sumsq:
 * on Hopper each tile read back from the L2 once its adds complete), which must match the sum
 * over the dw it left, taken here in double, to TOL_SUMSQ (the same squares summed in another
 * order; a tile read before its adds landed, or missed, is off by far more), and be the same bits
 * from the direct call. rows[s][e]: set s's rows of expert e. */
#define TOL_SUMSQ 1e-9
static double host_sumsq(const float *x, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}
static void check_sumsq(const struct mode *M, const char *what, double got, const float *dw, size_t n)
{
    const double want = host_sumsq(dw, n), err = fabs(got - want) / fmax(want, 1e-300);
    cr_expect(err <= TOL_SUMSQ, "%s [%s]: dw_sumsq %.17g, dw's own %.17g (rel err %.2e)", what, M->name, got, want, err);
}
static void wgrad_sets_case(const struct mode *M, mt_rng *rng, const char *tag, int NE, int NS,
                            const int *const *rows, int I, int O)
{
    char what[160];
    struct row_sets rs;
    make_row_sets(M, rng, NE, NS, rows, I, O, &rs);
    const struct expert_rows *g_sets = rs.g, *c_sets = rs.c;
    const size_t wn = (size_t)NE * O * I;
    int *rows_all = mt_calloc((size_t)NE, sizeof *rows_all);
    for (int e = 0; e < NE; e++)
        for (int k = 0; k < NS; k++) rows_all[e] += rows[k][e];

    /* adding onto random dw */
    float *dw0 = hrand(rng, wn, 1.0), *dw_ref = hdup(dw0, wn);
    float *d_dw = df_from(M, dw0, wn);
    double *d_ss = M->g->alloc(2 * sizeof(double)), ss[2], ss_cpu;
    M->g->expert_matmul_wgrad_sets(d_dw, g_sets, NS, NE, I, O, false, d_ss);
    M->c->expert_matmul_wgrad_sets(dw_ref, c_sets, NS, NE, I, O, false, &ss_cpu);
    float *dw = hf_of(M, d_dw, wn), *add = diff(dw, dw0, wn), *add_ref = diff(dw_ref, dw0, wn);
    M->g->download(ss, d_ss, sizeof(double));
    snprintf(what, sizeof what, "wgrad %d sets %s: adding", NS, tag);
    check_sumsq(M, what, ss[0], dw, wn);
    cr_expect(ss_cpu == host_sumsq(dw_ref, wn), "%s: the CPU's dw_sumsq is not its dw's", what);
    double worst = 0;
    bool empty_kept = true;
    for (int e = 0; e < NE; e++) {
        const size_t oi = (size_t)e * O * I;
        if (rows_all[e] == 0) {
            empty_kept = empty_kept && memcmp(dw + oi, dw0 + oi, (size_t)O * I * sizeof(float)) == 0;
            continue;
        }
        const double err = rel_err(add + oi, add_ref + oi, (size_t)O * I);
        cr_expect(err <= TOL_F32_LONG, "wgrad %d sets %s [%s] expert %d (%d rows): rel err %.2e", NS, tag, M->name, e,
                  rows_all[e], err);
        worst = fmax(worst, err);
    }
    fprintf(stderr, "gpu %s wgrad %d sets %-34s worst expert dw %.2e; no-row experts %s\n", M->name, NS, tag, worst,
            empty_kept ? "kept bit-exact" : "CHANGED");
    cr_expect(empty_kept, "wgrad %d sets %s [%s]: experts with no rows in any set changed", NS, tag, M->name);

    /* overwriting NaN: the CPU's zeros + the adds, zeros for experts with no rows */
    float *nans = fnew(wn);
    for (size_t i = 0; i < wn; i++) nans[i] = NAN;
    float *zref = fnew(wn);
    float *d_dwo = df_from(M, nans, wn);
    M->g->expert_matmul_wgrad_sets(d_dwo, g_sets, NS, NE, I, O, true, d_ss + 1);
    M->c->expert_matmul_wgrad_sets(zref, c_sets, NS, NE, I, O, true, NULL);
    float *dwo = hf_of(M, d_dwo, wn);
    M->g->download(ss + 1, d_ss + 1, sizeof(double));
    snprintf(what, sizeof what, "wgrad %d sets %s: overwriting", NS, tag);
    check_sumsq(M, what, ss[1], dwo, wn);
    snprintf(what, sizeof what, "wgrad %d sets %s: overwrite (vs CPU)", NS, tag);
    check_close(M, what, dwo, zref, wn, TOL_F32_LONG);
    for (int e = 0; e < NE; e++)
        if (rows_all[e] == 0) {
            snprintf(what, sizeof what, "wgrad %d sets %s: overwrite gives zeros to expert %d", NS, tag, e);
            check_exact(M, what, dwo + (size_t)e * O * I, zref + (size_t)e * O * I, (size_t)O * I * sizeof(float));
        }

#ifdef MT_HAVE_CUDA
    if (M->g->x_size == 2 && grouped_gemm_available()) {
        float *d_dw3 = df_from(M, dw0, wn);
        double *d_ss3 = M->g->alloc(sizeof(double)), ss3 = -1;
        const bool took = grouped_gemm_wgrad_sets(d_dw3, g_sets, NS, NE, I, O, false, d_ss3);
        const bool want = I % 8 == 0 && O % 8 == 0; /* what the kernel handles (grouped_gemm.cuh) */
        cr_expect(took == want, "wgrad %d sets %s: the grouped kernel took it: %d, expected %d", NS, tag, took, want);
        float *dw3 = hf_of(M, d_dw3, wn);
        snprintf(what, sizeof what, "wgrad %d sets %s: direct call = op", NS, tag);
        if (took) check_exact(M, what, dw3, dw, wn * sizeof(float));
        if (took) M->g->download(&ss3, d_ss3, sizeof(double));
        cr_expect(!took || memcmp(&ss3, ss, sizeof(double)) == 0,
                  "wgrad %d sets %s: dw_sumsq of the direct call %.17g, of the op %.17g (not the same bits)", NS,
                  tag, ss3, ss[0]);
        M->g->free(d_dw3), M->g->free(d_ss3);
        free(dw3);
    }
#endif
    free_row_sets(M, &rs);
    M->g->free(d_dw), M->g->free(d_dwo), M->g->free(d_ss);
    free(rows_all), free(dw0), free(dw_ref);
    free(dw), free(add), free(add_ref), free(nans), free(zref), free(dwo);
}

Test(gpu, expert_matmul_wgrad_sets)
{
    mt_rng rng;
    mt_rng_seed(&rng, 131);
    /* two sets: experts 1 and 5 have no rows in either; 3 set a only; 0 set b only */
    const int a[] = {0, 0, 127, 129, 300, 0, 64, 65};
    const int b[] = {65, 0, 1, 0, 200, 0, 63, 128};
    const int c[] = {31, 0, 0, 33, 0, 0, 1, 97};
    const int d[] = {0, 0, 40, 0, 0, 0, 128, 2};
    const int none[] = {0, 0, 0, 0, 0, 0, 0, 0};
    enum { MANY = 300 };
    int many[4][MANY];
    for (int k = 0; k < 4; k++)
        for (int e = 0; e < MANY; e++) many[k][e] = irand(&rng, 5);
    const int *ab[] = {a, b}, *ba[] = {b, a}, *a_[] = {a, none}, *_b[] = {none, b}, *__[] = {none, none};
    const int *many2[] = {many[0], many[1]}, *many4[] = {many[0], many[1], many[2], many[3]};
    const int *abc[] = {a, b, c}, *abcd[] = {a, b, c, d}, *a_c_[] = {a, none, c, none}, *_bcd[] = {none, b, c, d};
    const int *one[] = {b};
    /* eight sets (parallel.expert_wgrad_group 8): empty ones first, between and last */
    const int *eight[] = {none, a, b, none, c, d, a, none}, *eight_full[] = {a, b, c, d, b, a, d, c};
    /* 40 experts of 0-240 rows (every ninth none), 12 tiles each at 520->392: 480 tiles, more than
     * three rounds of a 132-SM grid, so the grouped kernel's heaviest-first order and its backward
     * odd rounds (grouped_gemm_tiles.cuh) place every tile once */
    enum { SKEW = 40 };
    int skew[2][SKEW];
    for (int k = 0; k < 2; k++)
        for (int e = 0; e < SKEW; e++) skew[k][e] = e % 9 == 4 ? 0 : (e * 53 + k * 17) % 241;
    const int *skew2[] = {skew[0], skew[1]};
    for (int i = 0; i < 2; i++) {
        struct mode M;
        mode_get(i, &M);
        wgrad_sets_case(&M, &rng, "edges 256->512", 8, 2, ab, 256, 512);
        wgrad_sets_case(&M, &rng, "many tiles 1032->904", 8, 2, ab, 1032, 904);
        wgrad_sets_case(&M, &rng, "I, O not /64 (200->136)", 8, 2, ba, 200, 136);
        wgrad_sets_case(&M, &rng, "300 experts 64->72", MANY, 2, many2, 64, 72);
        wgrad_sets_case(&M, &rng, "second set empty", 8, 2, a_, 256, 128);
        wgrad_sets_case(&M, &rng, "first set empty", 8, 2, _b, 256, 128);
        wgrad_sets_case(&M, &rng, "I, O not /8 (fallback)", 8, 2, ab, 100, 60);
        wgrad_sets_case(&M, &rng, "no rows at all", 8, 2, __, 64, 72);
        wgrad_sets_case(&M, &rng, "one set", 8, 1, one, 256, 128);
        wgrad_sets_case(&M, &rng, "edges 256->512", 8, 3, abc, 256, 512);
        wgrad_sets_case(&M, &rng, "many tiles 1032->904", 8, 4, abcd, 1032, 904);
        wgrad_sets_case(&M, &rng, "sets 2 and 4 empty", 8, 4, a_c_, 200, 136);
        wgrad_sets_case(&M, &rng, "first of four empty", 8, 4, _bcd, 256, 128);
        wgrad_sets_case(&M, &rng, "300 experts 64->72", MANY, 4, many4, 64, 72);
        wgrad_sets_case(&M, &rng, "I, O not /8 (fallback)", 8, 4, abcd, 100, 60);
        wgrad_sets_case(&M, &rng, "40 skewed experts, 480 tiles 520->392", SKEW, 2, skew2, 520, 392);
        wgrad_sets_case(&M, &rng, "eight sets, three empty", 8, 8, eight, 256, 512);
        wgrad_sets_case(&M, &rng, "eight sets 200->136", 8, 8, eight_full, 200, 136);
    }
}

#ifdef MT_HAVE_CUDA
/* expert_matmul_wgrad_part (ops.h): parts that stop where an exchange's flag says its rows
 * arrived, then the rest, make the bits of one expert_matmul_wgrad_sets, and the CPU's sums to
 * TOL_F32_LONG. The flag is in mapped host memory, set by this thread: before the first part
 * (nothing taken), ~200 us into it (a split wherever the kernel was), or never (all taken). A part
 * after the last (until NULL, called once) finds nothing left. Adding onto random dw and
 * overwriting NaN. */
static void wgrad_part_case(const struct mode *M, mt_rng *rng, const char *tag, int NE, int NS,
                            const int *const *rows, int I, int O, bool overwrite)
{
    char what[200];
    struct row_sets rs;
    make_row_sets(M, rng, NE, NS, rows, I, O, &rs);
    const struct expert_rows *g_sets = rs.g, *c_sets = rs.c;
    const size_t wn = (size_t)NE * O * I;
    float *dw0 = hrand(rng, wn, 1.0);
    if (overwrite)
        for (size_t i = 0; i < wn; i++) dw0[i] = NAN;
    float *d_one = df_from(M, dw0, wn);
    M->g->expert_matmul_wgrad_sets(d_one, g_sets, NS, NE, I, O, overwrite, NULL);
    float *one = hf_of(M, d_one, wn), *ref = hdup(dw0, wn);
    M->c->expert_matmul_wgrad_sets(ref, c_sets, NS, NE, I, O, overwrite, NULL);
    snprintf(what, sizeof what, "wgrad part %s%s: one call vs CPU", tag, overwrite ? " (overwrite)" : "");
    check_close(M, what, one, ref, wn, TOL_F32_LONG);

    uint32_t *flags_h = NULL, *flags_d = NULL;
    cr_assert_eq(cudaHostAlloc((void **)&flags_h, 2 * sizeof *flags_h, cudaHostAllocMapped), cudaSuccess);
    cr_assert_eq(cudaHostGetDevicePointer((void **)&flags_d, flags_h, 0), cudaSuccess);
    const struct exchange_arrival until = {flags_d, 7, 2, 0}; /* flag 0 is this rank's own */
    int32_t *cursor = M->g->alloc(2 * sizeof(int32_t));
    const char *when[] = {"arrived before", "arrives at ~200 us", "never arrives"};
    for (int split = 0; split < 3; split++) {
        float *d_dw = df_from(M, dw0, wn);
        M->g->zero(cursor, 2 * sizeof(int32_t));
        flags_h[0] = 0;
        ((volatile uint32_t *)flags_h)[1] = split == 0 ? 7 : 6;
        M->g->expert_matmul_wgrad_part(d_dw, g_sets, NS, NE, I, O, overwrite, cursor, &until);
        if (split == 1) {
            usleep(200);
            ((volatile uint32_t *)flags_h)[1] = 7;
        }
        int32_t taken[2];
        M->g->download(taken, cursor, sizeof taken); /* waits for the part */
        float *mid = hf_of(M, d_dw, wn);
        if (split == 0) {
            snprintf(what, sizeof what, "wgrad part %s: nothing taken once arrived", tag);
            check_exact(M, what, mid, dw0, wn * sizeof(float));
        }
        ((volatile uint32_t *)flags_h)[1] = split == 2 ? 6 : 7;
        if (split == 2) M->g->expert_matmul_wgrad_part(d_dw, g_sets, NS, NE, I, O, overwrite, cursor, &until);
        M->g->expert_matmul_wgrad_part(d_dw, g_sets, NS, NE, I, O, overwrite, cursor, NULL); /* the last */
        ((volatile uint32_t *)flags_h)[1] = 6;
        M->g->expert_matmul_wgrad_part(d_dw, g_sets, NS, NE, I, O, overwrite, cursor, &until); /* none left */
        float *got = hf_of(M, d_dw, wn);
        snprintf(what, sizeof what, "wgrad part %s%s, flag %s: parts = one call", tag, overwrite ? " (overwrite)" : "",
                 when[split]);
        check_exact(M, what, got, one, wn * sizeof(float));
        fprintf(stderr, "gpu %s wgrad part %-28s%s flag %-18s: first part claimed %d (done %d), the rest after\n",
                M->name, tag, overwrite ? " overwrite" : "", when[split], taken[0], taken[1]);
        M->g->free(d_dw);
        free(mid), free(got);
    }
    cudaFreeHost(flags_h);
    M->g->free(cursor), M->g->free(d_one);
    free_row_sets(M, &rs);
    free(dw0), free(one), free(ref);
}

Test(gpu, expert_matmul_wgrad_part_makes_the_bits_of_one_call)
{
    struct mode M;
    mt_rng rng;
    mt_rng_seed(&rng, 141);
    /* 64 experts of 300-700 rows in two sets at 1024->768: ~2,300 tiles, a few ms */
    enum { NE = 64 };
    int big[2][NE];
    for (int k = 0; k < 2; k++)
        for (int e = 0; e < NE; e++) big[k][e] = e % 13 == 5 ? 0 : 300 + irand(&rng, 400);
    const int *big2[] = {big[0], big[1]};
    const int a[] = {0, 0, 127, 129, 300, 0, 64, 65}, b[] = {65, 0, 1, 0, 200, 0, 63, 128};
    const int *ab[] = {a, b};
    for (int i = 0; i < 2; i++) {
        mode_get(i, &M);
        wgrad_part_case(&M, &rng, "64 experts 1024->768", NE, 2, big2, 1024, 768, false);
        wgrad_part_case(&M, &rng, "64 experts 1024->768", NE, 2, big2, 1024, 768, true);
        wgrad_part_case(&M, &rng, "edges 256->512", 8, 2, ab, 256, 512, true);
        wgrad_part_case(&M, &rng, "I, O not /8 (fallback)", 8, 2, ab, 100, 60, false);
    }
}
#endif

/* MT_FORCE_SM80=1 (make test-gpu's sm_80 pass) must really take the sm_80 paths on a Hopper GPU,
 * or that pass would test the Hopper kernels twice. */
Test(gpu, force_sm80_declines_the_hopper_kernels)
{
    struct mode M;
    mode_get(1, &M);
#ifdef MT_HAVE_CUDA
    const bool forced = mt_env_flag("MT_FORCE_SM80");
    fprintf(stderr, "gpu MT_FORCE_SM80=%d: Hopper grouped GEMM %s\n", forced,
            grouped_gemm_available() ? "on" : "off (cuBLAS)");
    if (forced) cr_expect(!grouped_gemm_available(), "MT_FORCE_SM80=1 but the Hopper kernel runs");
#endif
}
