/* The step verdict (src/step_guard.c): which steps are applied, skipped, or stop the run. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "config.h"
#include "step_guard.h"

static struct step_guard guard_with(enum mt_nonfinite mode, int max_skipped, double spike)
{
    struct config c;
    config_defaults(&c);
    c.train.nonfinite = mode;
    c.train.max_skipped_steps = max_skipped;
    c.train.spike_factor = spike;
    struct step_guard g;
    step_guard_init(&g, &c.train);
    return g;
}

Test(step_guard, defaults_are_skip_and_five)
{
    struct config c;
    config_defaults(&c);
    cr_assert_eq(c.train.nonfinite, MT_NONFINITE_SKIP);
    cr_assert_eq(c.train.max_skipped_steps, 5);
    cr_assert_eq(c.train.spike_factor, 0);
}

Test(step_guard, finite_steps_apply)
{
    struct step_guard g = guard_with(MT_NONFINITE_SKIP, 5, 0);
    for (int s = 1; s <= 50; s++) cr_assert_eq(step_guard_judge(&g, s, 3.0 + s, 1.0), STEP_APPLY);
    cr_assert_eq(g.total_skipped, 0);
}

Test(step_guard, nonfinite_loss_or_norm_skips_and_counts)
{
    struct step_guard g = guard_with(MT_NONFINITE_SKIP, 5, 0);
    cr_assert_eq(step_guard_judge(&g, 1, NAN, 1.0), STEP_SKIP);
    cr_assert(strstr(g.why, "non-finite loss"), "%s", g.why);
    cr_assert_eq(step_guard_judge(&g, 2, 2.0, INFINITY), STEP_SKIP);
    cr_assert(strstr(g.why, "non-finite gradient norm"), "%s", g.why);
    cr_assert_eq(g.consecutive, 2);
    cr_assert_eq(step_guard_judge(&g, 3, 2.0, 1.0), STEP_APPLY);
    cr_assert_eq(g.consecutive, 0, "an applied step ends the run of skips");
    cr_assert_eq(g.total_skipped, 2, "the total is kept");
}

Test(step_guard, max_skipped_in_a_row_stops)
{
    struct step_guard g = guard_with(MT_NONFINITE_SKIP, 3, 0);
    cr_assert_eq(step_guard_judge(&g, 1, NAN, NAN), STEP_SKIP);
    cr_assert_eq(step_guard_judge(&g, 2, NAN, NAN), STEP_SKIP);
    cr_assert_eq(step_guard_judge(&g, 3, NAN, NAN), STEP_STOP);
    char msg[512];
    step_guard_stop_message(&g, msg, sizeof msg);
    cr_assert(strstr(msg, "3 steps in a row") && strstr(msg, "max_skipped_steps 3"), "%s", msg);
    cr_assert_null(strchr(msg, '\n'));
}

Test(step_guard, stop_mode_stops_at_the_first_bad_step)
{
    struct step_guard g = guard_with(MT_NONFINITE_STOP, 5, 0);
    cr_assert_eq(step_guard_judge(&g, 1, 4.0, 1.0), STEP_APPLY);
    cr_assert_eq(step_guard_judge(&g, 2, -INFINITY, 1.0), STEP_STOP);
    char msg[512];
    step_guard_stop_message(&g, msg, sizeof msg);
    cr_assert(strstr(msg, "train.nonfinite: stop") && strstr(msg, "step 2"), "%s", msg);
}

Test(step_guard, spike_needs_history_then_skips_against_the_applied_mean)
{
    struct step_guard g = guard_with(MT_NONFINITE_SKIP, 5, 2.0);
    /* too little history: a big loss is applied */
    cr_assert_eq(step_guard_judge(&g, 1, 10.0, 1.0), STEP_APPLY);
    for (int s = 2; s <= STEP_GUARD_MIN_HISTORY; s++) cr_assert_eq(step_guard_judge(&g, s, 10.0, 1.0), STEP_APPLY);
    /* mean 10: 19.9 passes, 20.1 is a spike */
    cr_assert_eq(step_guard_judge(&g, 10, 19.9, 1.0), STEP_APPLY);
    double mean = (10.0 * STEP_GUARD_MIN_HISTORY + 19.9) / (STEP_GUARD_MIN_HISTORY + 1);
    cr_assert_eq(step_guard_judge(&g, 11, 2 * mean + 0.01, 1.0), STEP_SKIP);
    cr_assert(strstr(g.why, "spike"), "%s", g.why);
    /* a skipped loss does not enter the mean */
    cr_assert_eq(g.n_recent, STEP_GUARD_MIN_HISTORY + 1);
    cr_assert_eq(step_guard_judge(&g, 12, 2 * mean - 0.01, 1.0), STEP_APPLY);
}

Test(step_guard, decide_without_mpi_is_judge)
{
    struct step_guard g = guard_with(MT_NONFINITE_SKIP, 2, 0);
    cr_assert_eq(step_guard_decide(&g, 1, 1.0, 1.0, MPI_COMM_NULL), STEP_APPLY);
    cr_assert_eq(step_guard_decide(&g, 2, NAN, 1.0, MPI_COMM_NULL), STEP_SKIP);
    cr_assert_eq(step_guard_decide(&g, 3, NAN, 1.0, MPI_COMM_NULL), STEP_STOP);
}
