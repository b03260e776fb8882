/* The MoE expert-parallel token dispatch under mpirun: tests/mpi/dispatch_check.c drives moe.c's
 * dispatch, combine and their backward with chosen routings on 1, 2 and 4 EP ranks and checks every
 * row (see that file). Each case runs on every EP size; "corrupt" alters one received value and
 * must be reported, which shows the checker can fail. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "../test_util.h"

/* Runs dispatch_check CASE on np ranks; returns its exit status, its output in *out. */
static int run_dispatch_check(int np, const char *kase, char **out)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np %d %s/tests/mpi/dispatch_check %s", tu_mpirun(), np,
             tu_build(), kase);
    return tu_run(cmd, out);
}

static void expect_ok_on_1_2_4(const char *kase)
{
    static const int nps[] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        char *out = NULL;
        int rc = run_dispatch_check(nps[i], kase, &out);
        cr_expect_eq(rc, 0, "dispatch_check %s on %d rank(s) exited %d:\n%s", kase, nps[i], rc, out);
        char want[128];
        snprintf(want, sizeof want, "dispatch_check %s: ok on %d rank(s)", kase, nps[i]);
        cr_expect(out && strstr(out, want), "no '%s' in:\n%s", want, out ? out : "");
        free(out);
    }
}

/* hashed routing, k = 2: tokens pick experts on different EP ranks */
Test(dispatch, spread_top2, .timeout = 400) { expect_ok_on_1_2_4("spread"); }
/* k = 4, one expert in each quarter: on 4 ranks every token goes to every EP rank */
Test(dispatch, token_on_every_ep_rank, .timeout = 400) { expect_ok_on_1_2_4("cross"); }
/* only experts 0, 1, 3 chosen: empty experts and EP ranks that receive nothing */
Test(dispatch, experts_and_ranks_with_no_tokens, .timeout = 400) { expect_ok_on_1_2_4("sparse"); }
/* every token of every rank to expert 5 (k = 1) */
Test(dispatch, all_tokens_to_one_expert, .timeout = 400) { expect_ok_on_1_2_4("one_expert"); }
/* every token to the last two experts: one EP rank gets every row */
Test(dispatch, all_tokens_to_one_ep_rank, .timeout = 400) { expect_ok_on_1_2_4("one_rank"); }
Test(dispatch, top1, .timeout = 400) { expect_ok_on_1_2_4("top1"); }
/* k = E: every token to every expert */
Test(dispatch, top_k_equals_experts, .timeout = 400) { expect_ok_on_1_2_4("topE"); }
/* skewed per-rank routing on top of per-rank token counts that differ */
Test(dispatch, uneven_counts, .timeout = 400) { expect_ok_on_1_2_4("uneven"); }

Test(dispatch, a_corrupted_row_is_reported, .timeout = 200)
{
    char *out = NULL;
    int rc = run_dispatch_check(2, "corrupt", &out);
    cr_expect_eq(rc, 1, "dispatch_check corrupt exited %d (expected 1):\n%s", rc, out);
    cr_expect(out && strstr(out, "dispatch_check corrupt: rank 1 of 2: expert-side row"),
              "no report of the altered row in:\n%s", out ? out : "");
    free(out);
}
