/* The CUDA route and pair plans and the fp32 gather (cuda/moe_route.cu) against the CPU ones
 * (src/cpu/cpu_moe.c): integers only, so the plans must be identical, on fresh random routings
 * (distinct experts per token, shuffled order, weights that travel with their expert; for the
 * route plan also empty MT_NO_EXPERT slots, as a receiver's pair metadata has). Skipped without a
 * GPU unless MT_REQUIRE_GPU=1. */
#include <criterion/criterion.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "gpu_backend.h"
#include "ops.h"

/* k distinct experts of E per token in random order, weights that name their expert; with
 * empties, each token's last few slots are MT_NO_EXPERT (weight 0) */
static void random_routing(mt_rng *rng, int32_t *idx, float *w, int T, int E, int k, bool empties)
{
    int32_t *perm = mt_malloc((size_t)E * sizeof *perm);
    for (int t = 0; t < T; t++) {
        for (int e = 0; e < E; e++) perm[e] = e;
        const int used = empties ? 1 + (int)(mt_rng_next(rng) % (uint64_t)k) : k;
        for (int j = 0; j < k; j++) {
            int p = j + (int)(mt_rng_next(rng) % (uint64_t)(E - j));
            int32_t x = perm[j]; perm[j] = perm[p]; perm[p] = x;
            idx[(size_t)t * k + j] = j < used ? perm[j] : MT_NO_EXPERT;
            w[(size_t)t * k + j] = j < used ? (float)perm[j] + 0.25f : 0.0f;
        }
    }
    free(perm);
}

static void route_case(const struct backend *g, mt_rng *rng, int T, int E, int k, bool empties)
{
    const struct backend *c = backend_cpu();
    const size_t tk = (size_t)T * k;
    int32_t *idx = mt_malloc(tk * sizeof *idx);
    float *w = mt_malloc(tk * sizeof *w);
    random_routing(rng, idx, w, T, E, k, empties);
    int32_t *d_idx = g->alloc(tk * 4), *d_src = g->alloc(tk * 4), *d_slot = g->alloc(tk * 4);
    float *d_w = g->alloc(tk * 4);
    g->upload(d_idx, idx, tk * 4);
    g->upload(d_w, w, tk * 4);
    /* the offsets are backend memory; poisoned, so that an entry left unwritten shows */
    int64_t *off_g = mt_malloc(((size_t)E + 1) * 8), *off_c = mt_malloc(((size_t)E + 1) * 8);
    int64_t *d_off = g->alloc(((size_t)E + 1) * 8);
    memset(off_g, 0xff, ((size_t)E + 1) * 8);
    g->upload(d_off, off_g, ((size_t)E + 1) * 8);
    g->moe_route_plan(d_idx, d_w, d_src, d_slot, d_off, T, E, k);
    int32_t *src = mt_malloc(tk * 4), *slot = mt_malloc(tk * 4), *gidx = mt_malloc(tk * 4);
    float *gw = mt_malloc(tk * 4);
    c->moe_route_plan(idx, w, src, slot, off_c, T, E, k);
    int32_t *g_src = mt_malloc(tk * 4), *g_slot = mt_malloc(tk * 4);
    g->download(g_src, d_src, tk * 4);
    g->download(g_slot, d_slot, tk * 4);
    g->download(gidx, d_idx, tk * 4);
    g->download(gw, d_w, tk * 4);
    g->download(off_g, d_off, ((size_t)E + 1) * 8);
    cr_expect(!memcmp(off_g, off_c, ((size_t)E + 1) * 8), "T=%d E=%d k=%d: expert offsets differ", T, E, k);
    cr_expect(!memcmp(gidx, idx, tk * 4), "T=%d E=%d k=%d: sorted top-k ids differ", T, E, k);
    cr_expect(!memcmp(gw, w, tk * 4), "T=%d E=%d k=%d: sorted weights differ", T, E, k);
    const int64_t n_rows = off_c[E]; /* src_row holds one entry per filled slot; the rest is never written */
    cr_expect(!memcmp(g_src, src, (size_t)n_rows * 4), "T=%d E=%d k=%d: src_row differs", T, E, k);
    cr_expect(!memcmp(g_slot, slot, tk * 4), "T=%d E=%d k=%d: slot_row differs", T, E, k);
    /* and the CPU plan itself is the documented one: ascending ids, weights alongside, rows by
     * (expert, token) */
    int64_t rows = off_c[E], filled = 0;
    cr_expect_eq(off_c[0], 0);
    for (int e = 0; e < E; e++) cr_expect_leq(off_c[e], off_c[e + 1], "offsets decrease at expert %d", e);
    for (size_t i = 0; i < tk; i++) filled += idx[i] != MT_NO_EXPERT;
    cr_expect_eq(rows, filled);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            size_t i = (size_t)t * k + j;
            if (j && idx[i] != MT_NO_EXPERT) cr_expect_lt(idx[i - 1], idx[i], "token %d not sorted", t);
            if (j && idx[i - 1] == MT_NO_EXPERT) cr_expect_eq(idx[i], MT_NO_EXPERT, "token %d: an id after an empty slot", t);
            if (idx[i] == MT_NO_EXPERT) {
                cr_expect_eq(slot[i], -1, "empty slot %d of token %d has a row", j, t);
                continue;
            }
            cr_expect_eq(w[i], (float)idx[i] + 0.25f);
            cr_expect_eq(src[slot[i]], t);
            if (j) cr_expect_lt(slot[i - 1], slot[i]);
        }
    g->free(d_idx), g->free(d_src), g->free(d_slot), g->free(d_w), g->free(d_off);
    free(idx), free(w), free(off_g), free(off_c), free(src), free(slot), free(gidx);
    free(gw), free(g_src), free(g_slot);
}

Test(gpu, moe_route_plan)
{
    const struct backend *g = gpu_backend_or_skip(false);
    mt_rng rng;
    mt_rng_seed(&rng, 77);
    route_case(g, &rng, 8192, 128, 8, false); /* the bench shape */
    route_case(g, &rng, 1000, 64, 3, false);  /* partial last chunk, odd k */
    route_case(g, &rng, 33, 4, 4, false);     /* k = E: every token picks every expert */
    route_case(g, &rng, 5, 300, 1, false);    /* more experts than tokens: many empty */
    route_case(g, &rng, 3000, 64, 8, true);   /* a receiver's pairs: empty slots at the end */
}

static void pair_case(const struct backend *g, mt_rng *rng, int T, int ep, int nl, int k)
{
    const struct backend *c = backend_cpu();
    const size_t tk = (size_t)T * k, P = (size_t)T * (k < ep ? k : ep), pk = P * k;
    int32_t *idx = mt_malloc(tk * 4), *c_idx = mt_malloc(tk * 4);
    float *w = mt_malloc(tk * 4), *c_w = mt_malloc(tk * 4);
    random_routing(rng, idx, w, T, ep * nl, k, false);
    memcpy(c_idx, idx, tk * 4);
    memcpy(c_w, w, tk * 4);
    int32_t *c_pt = mt_malloc(P * 4), *c_tp = mt_malloc(tk * 4), *c_mi = mt_malloc(pk * 4);
    int32_t *c_wm = mt_malloc(tk * 4);
    float *c_mw = mt_malloc(pk * 4);
    int64_t *c_cnt = mt_malloc((size_t)ep * 8), *g_cnt = mt_malloc((size_t)ep * 8);
    int64_t *c_rows = mt_malloc((size_t)ep * 8), *g_rows = mt_malloc((size_t)ep * 8);
    c->moe_pair_plan(c_idx, c_w, c_pt, c_tp, c_mi, c_mw, c_wm, c_cnt, c_rows, T, ep, nl, k, 0);
    int32_t *d_idx = g->alloc(tk * 4), *d_pt = g->alloc(P * 4), *d_tp = g->alloc(tk * 4);
    int32_t *d_mi = g->alloc(pk * 4), *d_wm = g->alloc(tk * 4);
    float *d_w = g->alloc(tk * 4), *d_mw = g->alloc(pk * 4);
    g->upload(d_idx, idx, tk * 4);
    g->upload(d_w, w, tk * 4);
    g->moe_pair_plan(d_idx, d_w, d_pt, d_tp, d_mi, d_mw, d_wm, g_cnt, g_rows, T, ep, nl, k, 0);
    int64_t pairs = 0;
    for (int d = 0; d < ep; d++) pairs += c_cnt[d];
    cr_expect(!memcmp(g_cnt, c_cnt, (size_t)ep * 8), "T=%d ep=%d: pair counts differ", T, ep);
    cr_expect(!memcmp(g_rows, c_rows, (size_t)ep * 8), "T=%d ep=%d: expert-row counts differ", T, ep);
    int64_t choices = 0;
    for (int d = 0; d < ep; d++) choices += c_rows[d];
    cr_expect_eq(choices, (int64_t)T * k, "T=%d ep=%d: every choice is some rank's expert row", T, ep);
    int32_t *h = mt_malloc(pk * 4);
    float *hf = mt_malloc(pk * 4);
    g->download(h, d_idx, tk * 4);
    cr_expect(!memcmp(h, c_idx, tk * 4), "T=%d ep=%d: sorted ids differ", T, ep);
    g->download(hf, d_w, tk * 4);
    cr_expect(!memcmp(hf, c_w, tk * 4), "T=%d ep=%d: sorted weights differ", T, ep);
    g->download(h, d_pt, (size_t)pairs * 4);
    cr_expect(!memcmp(h, c_pt, (size_t)pairs * 4), "T=%d ep=%d: pair_tok differs", T, ep);
    g->download(h, d_tp, tk * 4);
    cr_expect(!memcmp(h, c_tp, tk * 4), "T=%d ep=%d: tok_pair differs", T, ep);
    g->download(h, d_wm, tk * 4);
    cr_expect(!memcmp(h, c_wm, tk * 4), "T=%d ep=%d: w_map differs", T, ep);
    g->download(h, d_mi, (size_t)pairs * k * 4);
    cr_expect(!memcmp(h, c_mi, (size_t)pairs * k * 4), "T=%d ep=%d: meta ids differ", T, ep);
    g->download(hf, d_mw, (size_t)pairs * k * 4);
    cr_expect(!memcmp(hf, c_mw, (size_t)pairs * k * 4), "T=%d ep=%d: meta weights differ", T, ep);
    /* the CPU plan is the documented one: each choice's weight is where w_map says, under its
     * local id, and its first choice on a rank names the pair of that token */
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            const size_t i = (size_t)t * k + j;
            const int d = c_idx[i] / nl, wm = c_wm[i];
            cr_expect_eq(c_mi[wm], c_idx[i] - d * nl, "token %d choice %d", t, j);
            cr_expect_eq(c_mw[wm], c_w[i]);
            cr_expect_eq(c_pt[wm / k], t);
            const bool first = j == 0 || c_idx[i - 1] / nl != d;
            cr_expect_eq(c_tp[i], first ? wm / k : -1);
        }
    /* and the fp32 gather brings the weights back through w_map */
    float *back = mt_malloc(tk * 4);
    g->gather_f32(d_w, d_mw, d_wm, (int)tk);
    g->download(back, d_w, tk * 4);
    cr_expect(!memcmp(back, c_w, tk * 4), "T=%d ep=%d: gather_f32 through w_map differs", T, ep);
    g->free(d_idx), g->free(d_pt), g->free(d_tp), g->free(d_mi), g->free(d_wm), g->free(d_w);
    g->free(d_mw);
    free(idx), free(c_idx), free(w), free(c_w), free(c_pt), free(c_tp), free(c_mi), free(c_wm);
    free(c_mw), free(c_cnt), free(g_cnt), free(c_rows), free(g_rows), free(h), free(hf), free(back);
}

Test(gpu, moe_pair_plan)
{
    const struct backend *g = gpu_backend_or_skip(false);
    mt_rng rng;
    mt_rng_seed(&rng, 78);
    pair_case(g, &rng, 8192, 2, 64, 8); /* the bench shape on 2 GPUs */
    pair_case(g, &rng, 4097, 8, 16, 8); /* EP=8, partial last chunk */
    pair_case(g, &rng, 300, 4, 2, 8);   /* k = E: every rank, several experts each */
    pair_case(g, &rng, 77, 16, 8, 3);   /* more ranks than choices */
}

/* The fixed exchange's block layout (block > 0, no host counts) and moe_rows_cap: the GPU's plan
 * equals the CPU's, padding included, on fresh random routings; then the receiver's route plan over
 * the blocks, held to a capacity below its rows, is cut the same way on both. */
static void block_case(const struct backend *g, mt_rng *rng, int T, int ep, int nl, int k, int blk)
{
    const struct backend *c = backend_cpu();
    const size_t tk = (size_t)T * k, P = (size_t)ep * blk, pk = P * k;
    int32_t *idx = mt_malloc(tk * 4), *c_idx = mt_malloc(tk * 4);
    float *w = mt_malloc(tk * 4), *c_w = mt_malloc(tk * 4);
    random_routing(rng, idx, w, T, ep * nl, k, false);
    memcpy(c_idx, idx, tk * 4);
    memcpy(c_w, w, tk * 4);
    int32_t *c_pt = mt_malloc(P * 4), *c_tp = mt_malloc(tk * 4), *c_mi = mt_malloc(pk * 4), *c_wm = mt_malloc(tk * 4);
    float *c_mw = mt_malloc(pk * 4);
    c->moe_pair_plan(c_idx, c_w, c_pt, c_tp, c_mi, c_mw, c_wm, NULL, NULL, T, ep, nl, k, blk);
    int32_t *d_idx = g->alloc(tk * 4), *d_pt = g->alloc(P * 4), *d_tp = g->alloc(tk * 4);
    int32_t *d_mi = g->alloc(pk * 4), *d_wm = g->alloc(tk * 4);
    float *d_w = g->alloc(tk * 4), *d_mw = g->alloc(pk * 4);
    g->upload(d_idx, idx, tk * 4);
    g->upload(d_w, w, tk * 4);
    int32_t *junk = mt_malloc(pk * 4);
    for (size_t i = 0; i < pk; i++) junk[i] = 12345; /* the padding must be written, not left */
    g->upload(d_pt, junk, P * 4);
    g->upload(d_mi, junk, pk * 4);
    g->moe_pair_plan(d_idx, d_w, d_pt, d_tp, d_mi, d_mw, d_wm, NULL, NULL, T, ep, nl, k, blk);
    int32_t *h = mt_malloc(pk * 4);
    float *hf = mt_malloc(pk * 4);
    g->download(h, d_pt, P * 4);
    cr_expect(!memcmp(h, c_pt, P * 4), "T=%d ep=%d block %d: pair_tok differs", T, ep, blk);
    g->download(h, d_mi, pk * 4);
    cr_expect(!memcmp(h, c_mi, pk * 4), "T=%d ep=%d block %d: meta ids differ", T, ep, blk);
    g->download(hf, d_mw, pk * 4);
    cr_expect(!memcmp(hf, c_mw, pk * 4), "T=%d ep=%d block %d: meta weights differ", T, ep, blk);
    g->download(h, d_tp, tk * 4);
    cr_expect(!memcmp(h, c_tp, tk * 4), "T=%d ep=%d block %d: tok_pair differs", T, ep, blk);
    g->download(h, d_wm, tk * 4);
    cr_expect(!memcmp(h, c_wm, tk * 4), "T=%d ep=%d block %d: w_map differs", T, ep, blk);

    /* receiver: every block as one rank's arrivals, its plan held to 90% of its rows */
    int32_t *c_src = mt_malloc(pk * 4), *c_slot = mt_malloc(pk * 4), *d_src = g->alloc(pk * 4), *d_slot = g->alloc(pk * 4);
    int64_t *c_off = mt_malloc(((size_t)nl + 1) * 8), *d_off = g->alloc(((size_t)nl + 1) * 8);
    int64_t c_need[2] = {5, 0}, *d_need = g->alloc(16), g_need[2];
    g->upload(d_need, c_need, 16);
    c->moe_route_plan(c_mi, c_mw, c_src, c_slot, c_off, (int)P, nl, k);
    g->moe_route_plan(d_mi, d_mw, d_src, d_slot, d_off, (int)P, nl, k);
    const int64_t rows = c_off[nl], cap = rows * 9 / 10;
    c->moe_rows_cap(c_off, c_src, c_slot, c_need, (int)pk, nl, cap);
    g->moe_rows_cap(d_off, d_src, d_slot, d_need, (int)pk, nl, cap);
    int64_t *g_off = mt_malloc(((size_t)nl + 1) * 8);
    g->download(g_off, d_off, ((size_t)nl + 1) * 8);
    g->download(g_need, d_need, 16);
    cr_expect(!memcmp(g_off, c_off, ((size_t)nl + 1) * 8), "T=%d ep=%d: cut offsets differ", T, ep);
    cr_expect_eq(c_off[nl], cap);
    cr_expect(g_need[0] == rows && g_need[1] == 1 && c_need[0] == rows && c_need[1] == 1,
              "need: GPU %lld/%lld, CPU %lld/%lld, rows %lld", (long long)g_need[0], (long long)g_need[1],
              (long long)c_need[0], (long long)c_need[1], (long long)rows);
    g->download(h, d_slot, pk * 4);
    cr_expect(!memcmp(h, c_slot, pk * 4), "T=%d ep=%d: cut slots differ", T, ep);
    g->download(h, d_src, (size_t)cap * 4);
    cr_expect(!memcmp(h, c_src, (size_t)cap * 4), "T=%d ep=%d: the kept rows' sources differ", T, ep);
    /* within the capacity nothing changes but the sources past the used rows */
    g->moe_rows_cap(d_off, d_src, d_slot, d_need, (int)pk, nl, rows);
    c->moe_rows_cap(c_off, c_src, c_slot, c_need, (int)pk, nl, rows);
    g->download(g_off, d_off, ((size_t)nl + 1) * 8);
    g->download(g_need, d_need, 16);
    cr_expect(g_off[nl] == cap && g_need[1] == 1, "a plan within the capacity was cut");
    g->download(h, d_src, (size_t)rows * 4);
    cr_expect(!memcmp(h, c_src, (size_t)rows * 4), "T=%d ep=%d: sources past the used rows differ", T, ep);
    for (int64_t r = cap; r < rows; r++)
        if (h[r] != -1) {
            cr_expect_eq(h[r], -1, "row %lld is past the used %lld: its source must be -1", (long long)r, (long long)cap);
            break;
        }
    g->free(d_idx), g->free(d_pt), g->free(d_tp), g->free(d_mi), g->free(d_wm), g->free(d_w), g->free(d_mw);
    g->free(d_src), g->free(d_slot), g->free(d_off), g->free(d_need);
    free(idx), free(c_idx), free(w), free(c_w), free(c_pt), free(c_tp), free(c_mi), free(c_wm), free(c_mw);
    free(junk), free(h), free(hf), free(c_src), free(c_slot), free(c_off), free(g_off);
}

Test(gpu, moe_pair_plan_in_blocks_and_rows_cap)
{
    const struct backend *g = gpu_backend_or_skip(false);
    mt_rng rng;
    mt_rng_seed(&rng, 91);
    block_case(g, &rng, 8192, 2, 64, 8, 8192); /* the bench shape on 2 GPUs */
    block_case(g, &rng, 4097, 8, 16, 8, 4099); /* EP=8, partial last chunk, blocks past T */
    block_case(g, &rng, 77, 16, 8, 3, 77);     /* more ranks than choices: mostly padding */
}

/* An expert id outside [0, E) found on the device (the plan does not wait for its kernels) stops
 * the run at the backend's next download, with the route plan's message and exit status 1. In a
 * child process, forked before anything touches CUDA; exit status 77 there: no GPU. */
static void bad_id_child(void)
{
    const struct backend *g = backend_cuda(false, 0);
    if (!g) _exit(77);
    enum { T = 64, E = 8, K = 2 };
    int32_t idx[T * K];
    float w[T * K];
    for (int t = 0; t < T; t++) {
        idx[t * K] = t % E;
        idx[t * K + 1] = (t + 1) % E;
        w[t * K] = w[t * K + 1] = 0.5f;
    }
    idx[5 * K + 1] = E + 3;
    int32_t *d_idx = g->alloc(sizeof idx), *d_src = g->alloc(sizeof idx), *d_slot = g->alloc(sizeof idx);
    float *d_w = g->alloc(sizeof w);
    int64_t off[E + 1], *d_off = g->alloc(sizeof off);
    g->upload(d_idx, idx, sizeof idx);
    g->upload(d_w, w, sizeof w);
    g->moe_route_plan(d_idx, d_w, d_src, d_slot, d_off, T, E, K);
    g->download(off, d_off, sizeof off);
    _exit(0); /* the download returned: the bad id went unnoticed */
}

Test(gpu, moe_route_plan_bad_id_stops_at_the_next_download)
{
    fflush(NULL);
    const pid_t pid = fork();
    cr_assert(pid >= 0, "fork failed");
    if (pid == 0) bad_id_child();
    int status = 0;
    cr_assert(waitpid(pid, &status, 0) == pid, "waitpid failed");
    cr_assert(WIFEXITED(status), "the child did not exit (signal %d)", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (WEXITSTATUS(status) == 77) gpu_backend_or_skip(false); /* skipped, or failed under MT_REQUIRE_GPU */
    cr_expect_eq(WEXITSTATUS(status), 1, "a bad expert id: exit status %d, expected 1 (0: not caught)",
                 WEXITSTATUS(status));
}
