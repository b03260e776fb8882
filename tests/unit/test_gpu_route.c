/* The CUDA route plan (cuda/moe_route.cu) against the CPU one (src/cpu/cpu_moe.c): integers only,
 * so the plans must be identical, on fresh random routings (distinct experts per token, shuffled
 * order, weights that travel with their expert). Skipped without a GPU unless MT_REQUIRE_GPU=1. */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "ops.h"

static const struct backend *gpu_or_skip(void)
{
    const struct backend *g = backend_cuda(false, 0);
    if (!g) {
        const char *req = getenv("MT_REQUIRE_GPU");
        cr_assert(!(req && *req && strcmp(req, "0")), "MT_REQUIRE_GPU is set but no CUDA device");
        cr_skip_test("no CUDA device");
    }
    return g;
}

static void route_case(const struct backend *g, mt_rng *rng, int T, int E, int k)
{
    const struct backend *c = backend_cpu();
    const size_t tk = (size_t)T * k;
    int32_t *idx = mt_malloc(tk * sizeof *idx), *perm = mt_malloc((size_t)E * sizeof *perm);
    float *w = mt_malloc(tk * sizeof *w);
    for (int t = 0; t < T; t++) {
        /* a partial Fisher-Yates shuffle: k distinct experts in random order */
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int j = 0; j < k; j++) {
            int p = j + (int)(mt_rng_next(rng) % (uint64_t)(E - j));
            int32_t x = perm[j]; perm[j] = perm[p]; perm[p] = x;
            idx[(size_t)t * k + j] = perm[j];
            w[(size_t)t * k + j] = (float)perm[j] + 0.25f; /* identifies its expert */
        }
    }
    int32_t *d_idx = g->alloc(tk * 4), *d_src = g->alloc(tk * 4), *d_slot = g->alloc(tk * 4);
    float *d_w = g->alloc(tk * 4);
    g->upload(d_idx, idx, tk * 4);
    g->upload(d_w, w, tk * 4);
    int64_t *cnt_g = mt_malloc((size_t)E * 8), *cnt_c = mt_malloc((size_t)E * 8);
    g->moe_route_plan(d_idx, d_w, d_src, d_slot, cnt_g, T, E, k);
    int32_t *src = mt_malloc(tk * 4), *slot = mt_malloc(tk * 4), *gidx = mt_malloc(tk * 4);
    float *gw = mt_malloc(tk * 4);
    c->moe_route_plan(idx, w, src, slot, cnt_c, T, E, k);
    int32_t *g_src = mt_malloc(tk * 4), *g_slot = mt_malloc(tk * 4);
    g->download(g_src, d_src, tk * 4);
    g->download(g_slot, d_slot, tk * 4);
    g->download(gidx, d_idx, tk * 4);
    g->download(gw, d_w, tk * 4);
    cr_expect(!memcmp(cnt_g, cnt_c, (size_t)E * 8), "T=%d E=%d k=%d: counts differ", T, E, k);
    cr_expect(!memcmp(gidx, idx, tk * 4), "T=%d E=%d k=%d: sorted top-k ids differ", T, E, k);
    cr_expect(!memcmp(gw, w, tk * 4), "T=%d E=%d k=%d: sorted weights differ", T, E, k);
    cr_expect(!memcmp(g_src, src, tk * 4), "T=%d E=%d k=%d: src_row differs", T, E, k);
    cr_expect(!memcmp(g_slot, slot, tk * 4), "T=%d E=%d k=%d: slot_row differs", T, E, k);
    /* and the CPU plan itself is the documented one: ascending ids, weights alongside, rows by
     * (expert, token) */
    int64_t rows = 0;
    for (int e = 0; e < E; e++) rows += cnt_c[e];
    cr_expect_eq(rows, (int64_t)tk);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            size_t i = (size_t)t * k + j;
            if (j) cr_expect_lt(idx[i - 1], idx[i], "token %d not sorted", t);
            cr_expect_eq(w[i], (float)idx[i] + 0.25f);
            cr_expect_eq(src[slot[i]], t);
            if (j) cr_expect_lt(slot[i - 1], slot[i]);
        }
    g->free(d_idx), g->free(d_src), g->free(d_slot), g->free(d_w);
    free(idx), free(perm), free(w), free(cnt_g), free(cnt_c), free(src), free(slot), free(gidx);
    free(gw), free(g_src), free(g_slot);
}

Test(gpu, moe_route_plan)
{
    const struct backend *g = gpu_or_skip();
    mt_rng rng;
    mt_rng_seed(&rng, 77);
    route_case(g, &rng, 8192, 128, 8); /* the bench shape */
    route_case(g, &rng, 1000, 64, 3);  /* partial last chunk, odd k */
    route_case(g, &rng, 33, 4, 4);     /* k = E: every token picks every expert */
    route_case(g, &rng, 5, 300, 1);    /* more experts than tokens: many empty */
}
