/* Tests of the fp32 CPU backend's MoE plans and row moves (src/cpu/cpu_moe.c; suite cpu_ops, as
 * test_cpu_moe_ops.c): the pair and route plans against their definitions (ops.h), the capacity
 * cut, and the row copies the dispatch makes from them (gather_rows_part, dispatch_rows) against
 * the one gather. */
#include <criterion/criterion.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "cpu/cpu_ops.h"
#include "cpu_grad_util.h"
#include "ops.h"

/* ---------------------------------------------------------------- route and pair plans */

/* T tokens, k distinct experts of E each in random order, weights naming their expert */
static void plan_routing(mt_rng *rng, int32_t *idx, float *w, int T, int E, int k)
{
    int32_t perm[64];
    for (int t = 0; t < T; t++) {
        for (int e = 0; e < E; e++) perm[e] = e;
        for (int j = 0; j < k; j++) {
            int p = j + (int)(mt_rng_next(rng) % (uint64_t)(E - j));
            int32_t x = perm[j]; perm[j] = perm[p]; perm[p] = x;
            idx[t * k + j] = perm[j];
            w[t * k + j] = (float)perm[j] + 0.5f;
        }
    }
}

/* The pair plan against its definition (ops.h): pairs by (rank, token), one per rank a token
 * uses; each choice's weight and local id where w_map says; the first choice per rank names the
 * pair. Then the receiver's route plan over the pairs' metadata, with its empty slots. */
Test(cpu_ops, pair_plan_and_route_plan_follow_their_definition)
{
    enum { T = 300, EP = 4, NL = 4, K = 6 };
    mt_rng rng;
    mt_rng_seed(&rng, 31);
    int32_t idx[T * K], pt[T * K], tp[T * K], wm[T * K], mi[T * K * K];
    float w[T * K], mw[T * K * K];
    int64_t cnt[EP], rows_for[EP];
    plan_routing(&rng, idx, w, T, EP * NL, K);
    cpu_moe_pair_plan(idx, w, pt, tp, mi, mw, wm, cnt, rows_for, T, EP, NL, K, 0);
    int64_t P = 0, want[EP] = {0}, want_rows[EP] = {0};
    for (int t = 0; t < T; t++) {
        bool uses[EP] = {false};
        for (int j = 0; j < K; j++) {
            const int i = t * K + j, d = idx[i] / NL;
            if (j) cr_assert_lt(idx[i - 1], idx[i], "token %d not sorted", t);
            cr_expect_eq(w[i], (float)idx[i] + 0.5f, "weight did not travel with its expert");
            cr_expect_eq(mi[wm[i]], idx[i] - d * NL);
            cr_expect_eq(mw[wm[i]], w[i]);
            cr_expect_eq(pt[wm[i] / K], t);
            cr_expect_eq(tp[i], uses[d] ? -1 : wm[i] / K);
            uses[d] = true;
            want_rows[d]++;
        }
        for (int d = 0; d < EP; d++) want[d] += uses[d];
    }
    for (int d = 0; d < EP; d++) {
        cr_expect_eq(cnt[d], want[d], "rank %d", d);
        cr_expect_eq(rows_for[d], want_rows[d], "rank %d's expert rows", d);
        P += cnt[d];
    }
    for (int64_t p = 1; p < P; p++) {
        /* (rank, token) order: the rank is that of the pair's first slot */
        int dp = pt[p - 1], dq = pt[p];
        int rp = -1, rq = -1;
        for (int j = 0; j < K; j++) {
            if (wm[dp * K + j] / K == p - 1) rp = idx[dp * K + j] / NL;
            if (wm[dq * K + j] / K == p) rq = idx[dq * K + j] / NL;
        }
        cr_expect(rp < rq || (rp == rq && dp < dq), "pairs %lld and %lld out of order", (long long)p - 1,
                  (long long)p);
    }
    for (int64_t p = 0; p < P; p++)
        for (int s = 1; s < K; s++)
            cr_expect(mi[p * K + s] > mi[p * K + s - 1] ||
                      (mi[p * K + s] == MT_NO_EXPERT && mi[p * K + s - 1] == MT_NO_EXPERT),
                      "pair %lld: slots not ascending, or a used slot after an empty one", (long long)p);

    /* the receiver's plan over these pairs (as if one rank received them all): rows by (local
     * expert, pair), none for empty slots */
    int32_t src[T * K * K], slot[T * K * K];
    int64_t off[NL + 1];
    cpu_moe_route_plan(mi, mw, src, slot, off, (int)P, NL, K);
    int64_t rows = 0;
    cr_expect_eq(off[0], 0);
    for (int e = 0; e < NL; e++) cr_expect_leq(off[e], off[e + 1], "offsets decrease at expert %d", e);
    for (int64_t p = 0; p < P; p++)
        for (int s = 0; s < K; s++) {
            if (mi[p * K + s] == MT_NO_EXPERT) {
                cr_expect_eq(slot[p * K + s], -1);
                continue;
            }
            rows++;
            const int r = slot[p * K + s], e = mi[p * K + s];
            cr_expect(r >= off[e] && r < off[e + 1], "slot row %d outside expert %d's rows", r, e);
            cr_expect_eq(src[r], (int32_t)p);
            if (r > off[e]) cr_expect_lt(src[r - 1], (int32_t)p);
        }
    cr_expect_eq(rows, off[NL]);
    /* what the senders' row counts promise the receiver (moe_exchange_counts) is its plan's rows */
    int64_t promised = 0;
    for (int d = 0; d < EP; d++) promised += rows_for[d];
    cr_expect_eq(promised, off[NL]);
}

/* The fixed exchange's layout (block > 0): token t's pair with rank d is the packed plan's pair,
 * moved to d·block + t; every other slot of a block is padding (no experts, its own token, 0 past
 * T), so a block's rows are the token rows; the token-side maps point at the moved pairs; the
 * counts are the packed plan's when asked for and may be left out. */
Test(cpu_ops, pair_plan_in_blocks_puts_each_pair_at_its_token)
{
    enum { T = 257, EP = 3, NL = 5, K = 4, BLK = T + 3 };
    mt_rng rng;
    mt_rng_seed(&rng, 77);
    int32_t idx[T * K], idx2[T * K], pt[T * K], tp[T * K], wm[T * K], mi[T * K * K];
    float w[T * K], w2[T * K], mw[T * K * K];
    int32_t bpt[EP * BLK], btp[T * K], bwm[T * K], bmi[EP * BLK * K];
    float bmw[EP * BLK * K];
    int64_t cnt[EP], rows_for[EP], bcnt[EP], brows[EP];
    plan_routing(&rng, idx, w, T, EP * NL, K);
    memcpy(idx2, idx, sizeof idx);
    memcpy(w2, w, sizeof w);
    cpu_moe_pair_plan(idx, w, pt, tp, mi, mw, wm, cnt, rows_for, T, EP, NL, K, 0);
    for (size_t i = 0; i < EP * BLK; i++) bpt[i] = -7; /* padding must be written */
    cpu_moe_pair_plan(idx2, w2, bpt, btp, bmi, bmw, bwm, bcnt, brows, T, EP, NL, K, BLK);
    cr_expect(!memcmp(idx, idx2, sizeof idx) && !memcmp(w, w2, sizeof w), "the sorted routing differs");
    cr_expect(!memcmp(cnt, bcnt, sizeof cnt) && !memcmp(rows_for, brows, sizeof cnt), "the counts differ");
    int64_t first[EP];
    for (int d = 0, o = 0; d < EP; o += (int)cnt[d], d++) first[d] = o;
    /* rank d's pair for token t sits at d * BLK + t; every other slot of the block is padding */
    static bool real[EP * BLK];
    memset(real, 0, sizeof real);
    for (int d = 0; d < EP; d++)
        for (int64_t p = first[d]; p < first[d] + cnt[d]; p++) {
            const int64_t b = d * BLK + pt[p];
            real[b] = true;
            for (int s = 0; s < K; s++) {
                cr_expect_eq(bmi[b * K + s], mi[p * K + s], "rank %d token %d slot %d", d, pt[p], s);
                cr_expect_eq(bmw[b * K + s], mw[p * K + s]);
            }
        }
    for (int d = 0; d < EP; d++)
        for (int64_t i = 0; i < BLK; i++) {
            const int64_t b = d * BLK + i;
            cr_expect_eq(bpt[b], i < T ? (int32_t)i : 0, "rank %d slot %lld: its token", d, (long long)i);
            for (int s = 0; s < K && !real[b]; s++) {
                cr_expect_eq(bmi[b * K + s], MT_NO_EXPERT, "rank %d slot %lld is padding", d, (long long)i);
                cr_expect_eq(bmw[b * K + s], 0.0f);
            }
        }
    for (int i = 0; i < T * K; i++) { /* token side: the same slot of the pair at d * BLK + token */
        const int d = idx[i] / NL;
        const int64_t moved = (int64_t)d * BLK + i / K;
        cr_expect_eq(bwm[i], moved * K + wm[i] % K, "choice %d: w_map", i);
        cr_expect_eq(btp[i], tp[i] < 0 ? -1 : (int32_t)moved, "choice %d: tok_pair", i);
    }
    /* without the host counts: the same plan */
    int32_t cpt[EP * BLK], cmi[EP * BLK * K];
    memcpy(idx2, idx, sizeof idx);
    cpu_moe_pair_plan(idx2, w2, cpt, btp, cmi, bmw, bwm, NULL, NULL, T, EP, NL, K, BLK);
    cr_expect(!memcmp(cpt, bpt, sizeof cpt) && !memcmp(cmi, bmi, sizeof cmi), "the plan without counts differs");
}

/* moe_rows_cap: a plan within the capacity is left alone but for the sources of the rows past
 * its used ones (the need still recorded); one past it is cut to the capacity, its slots past it
 * emptied, and counted */
Test(cpu_ops, rows_cap_records_the_need_and_cuts_past_the_capacity)
{
    int64_t off[4] = {0, 3, 3, 7};
    int32_t slot[6] = {0, 6, -1, 2, 5, 3}, src[9] = {4, 4, 4, 4, 4, 4, 4, 4, 4};
    int64_t need[2] = {0, 0};
    cpu_moe_rows_cap(off, src, slot, need, 6, 3, 9);
    cr_expect(off[1] == 3 && off[3] == 7 && slot[1] == 6 && slot[4] == 5, "a plan within the capacity changed");
    cr_expect(src[6] == 4 && src[7] == -1 && src[8] == -1, "rows 7 and 8 are past the used ones");
    cr_expect(need[0] == 7 && need[1] == 0, "need %lld, cut %lld", (long long)need[0], (long long)need[1]);
    cpu_moe_rows_cap(off, src, slot, need, 6, 3, 4);
    const int64_t want_off[4] = {0, 3, 3, 4};
    const int32_t want_slot[6] = {0, -1, -1, 2, -1, 3};
    cr_expect(!memcmp(off, want_off, sizeof off), "offsets %lld %lld %lld %lld", (long long)off[0],
              (long long)off[1], (long long)off[2], (long long)off[3]);
    cr_expect(!memcmp(slot, want_slot, sizeof slot), "slots past the capacity must be emptied");
    cr_expect(need[0] == 7 && need[1] == 1, "need %lld, cut %lld", (long long)need[0], (long long)need[1]);
    int64_t off2[4] = {0, 5, 9, 9};
    cpu_moe_rows_cap(off2, src, slot, need, 6, 3, 4);
    cr_expect(need[0] == 9 && need[1] == 2, "the largest need and every cut plan count");
}

/* gather_rows_part's two parts, inside [2, 4) from a buffer of their own and outside from the
 * whole one, give the one gather over the whole buffer; each part leaves the other's rows (and
 * the negative indices') as they are */
Test(cpu_ops, gather_rows_part_is_one_gather_in_two)
{
    enum { N = 6, H = 3, R = 9 };
    float all[N * H], out[R * H], ref[R * H], inside_only[R * H];
    for (int i = 0; i < N * H; i++) all[i] = (float)(i * 7 % 23) - 11.0f;
    const int32_t idx[R] = {5, 2, -1, 3, 0, 3, 1, 4, 2};
    for (int i = 0; i < R * H; i++) out[i] = ref[i] = inside_only[i] = 100.0f + (float)i;
    cpu_gather_rows(ref, all, idx, R, H);
    cpu_gather_rows_part(out, all + 2 * H, idx, R, H, 2, 4, true);
    memcpy(inside_only, out, sizeof out);
    cpu_gather_rows_part(out, all, idx, R, H, 2, 4, false);
    cr_expect(!memcmp(out, ref, sizeof ref), "the two parts differ from the one gather");
    for (int r = 0; r < R; r++) {
        const bool inside = idx[r] >= 2 && idx[r] < 4;
        for (int h = 0; h < H; h++)
            cr_expect_eq(inside_only[r * H + h], inside ? ref[r * H + h] : 100.0f + (float)(r * H + h),
                         "row %d (index %d) after the inside part", r, (int)idx[r]);
    }
}

/* gather_rows leaves a row whose index is negative as it is */
Test(cpu_ops, gather_rows_skips_negative_indices)
{
    float in[6] = {1, 2, 3, 4, 5, 6}, out[6] = {-1, -1, -1, -1, -1, -1};
    const int32_t idx[3] = {2, -1, 0};
    cpu_gather_rows(out, in, idx, 3, 2);
    const float want[6] = {5, 6, -1, -1, 1, 2};
    cr_expect(!memcmp(out, want, sizeof want), "%g %g %g %g %g %g", out[0], out[1], out[2], out[3], out[4], out[5]);
}

/* A random route plan of T tokens' top-k among E experts, some slots MT_NO_EXPERT (the pairs'
 * padding), optionally cut to a capacity; returns its rows */
static int64_t random_route_plan(int32_t *src, int32_t *slot, int T, int E, int k, int64_t cap, unsigned seed)
{
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)T * k);
    float *w = malloc(sizeof(float) * (size_t)T * k);
    int64_t off[E + 1], need[2] = {0, 0};
    srand(seed);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e;
            bool fresh;
            do { /* distinct experts a token */
                e = rand() % (E + 2) < E ? rand() % E : MT_NO_EXPERT;
                fresh = true;
                for (int i = 0; i < j; i++) fresh = fresh && (e == MT_NO_EXPERT || idx[t * k + i] != e);
            } while (!fresh);
            idx[t * k + j] = e;
            w[t * k + j] = 1.0f;
        }
    cpu_moe_route_plan(idx, w, src, slot, off, T, E, k);
    if (cap > 0 && cap < off[E]) cpu_moe_rows_cap(off, src, slot, need, T * k, E, cap);
    free(idx);
    free(w);
    return off[E];
}

/* dispatch_rows by a plan's slots writes what gather_rows by its source rows writes, and leaves
 * the rows no slot names (past a capacity cut, past the used rows) as they are; a plan with one
 * slot emptied must then differ (the comparison sees a skipped row) */
Test(cpu_ops, dispatch_rows_by_slot_is_the_gather_by_row)
{
    enum { T = 37, E = 9, K = 4, H = 5, RMAX = T * K };
    int32_t src[RMAX], slot[T * K];
    float in[T * H], by_row[RMAX * H], by_slot[RMAX * H];
    for (int i = 0; i < T * H; i++) in[i] = (float)((i * 37) % 101) - 50.0f;
    for (int trial = 0; trial < 6; trial++) {
        const int64_t cap = trial % 2 ? 60 + trial : 0; /* odd trials: a plan cut to a capacity */
        for (int r = 0; r < RMAX; r++) src[r] = -1;
        const int64_t rows = random_route_plan(src, slot, T, E, K, cap, 11u + (unsigned)trial);
        const int R = (int)(cap > 0 ? MT_MIN(rows, cap) : rows);
        cr_assert(R > 0 && R <= RMAX, "trial %d: %d rows", trial, R);
        for (int i = 0; i < RMAX * H; i++) by_row[i] = by_slot[i] = -1000.0f - (float)i;
        cpu_gather_rows(by_row, in, src, R, H);
        cpu_dispatch_rows(by_slot, in, slot, T, K, H);
        cr_expect(!memcmp(by_row, by_slot, sizeof by_row), "trial %d (capacity %lld): by slot != by row", trial,
                  (long long)cap);
        int empty = 0;
        for (int i = 0; i < T * K; i++) empty += slot[i] < 0;
        cr_expect(trial % 2 == 0 || empty > 0, "trial %d: the capacity cut emptied no slot", trial);
        /* one slot skipped: the copy must differ from the gather */
        int j = 0;
        while (slot[j] < 0) j++;
        const int32_t kept = slot[j];
        slot[j] = -1;
        for (int i = 0; i < RMAX * H; i++) by_slot[i] = -1000.0f - (float)i;
        cpu_dispatch_rows(by_slot, in, slot, T, K, H);
        cr_expect(memcmp(by_row, by_slot, sizeof by_row) != 0, "trial %d: a skipped slot (row %d) went unseen",
                  trial, (int)kept);
    }
}
