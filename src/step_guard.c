#include "step_guard.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

void step_guard_init(struct step_guard *g, const struct train_config *t)
{
    memset(g, 0, sizeof *g);
    g->nonfinite = t->nonfinite;
    g->max_skipped = t->max_skipped_steps;
    g->spike_factor = t->spike_factor;
}

static double recent_mean(const struct step_guard *g)
{
    double s = 0;
    for (int i = 0; i < g->n_recent; i++) s += g->recent[i];
    return s / g->n_recent;
}

enum step_verdict step_guard_judge(struct step_guard *g, int step, double loss, double grad_norm)
{
    bool bad_loss = !isfinite(loss), bad_norm = !isfinite(grad_norm);
    if (bad_loss || bad_norm) {
        snprintf(g->why, sizeof g->why, "step %d: non-finite %s (loss %g, gradient norm %g)", step,
                 bad_loss && bad_norm ? "loss and gradient norm" : bad_loss ? "loss" : "gradient norm",
                 loss, grad_norm);
        if (g->nonfinite == MT_NONFINITE_STOP) return STEP_STOP;
    } else if (g->spike_factor > 0 && g->n_recent >= STEP_GUARD_MIN_HISTORY &&
               loss > g->spike_factor * recent_mean(g)) {
        snprintf(g->why, sizeof g->why, "step %d: loss spike (%.4g > train.spike_factor %g x %.4g, the "
                 "mean of the last %d applied steps)", step, loss, g->spike_factor, recent_mean(g),
                 g->n_recent);
    } else {
        g->consecutive = 0;
        g->recent[g->next] = loss;
        g->next = (g->next + 1) % STEP_GUARD_WINDOW;
        if (g->n_recent < STEP_GUARD_WINDOW) g->n_recent++;
        return STEP_APPLY;
    }
    g->consecutive++;
    g->total_skipped++;
    return g->consecutive >= g->max_skipped ? STEP_STOP : STEP_SKIP;
}

enum step_verdict step_guard_decide(struct step_guard *g, int step, double loss, double grad_norm,
                                    MPI_Comm comm)
{
    struct step_guard before = *g;
    int mine = (int)step_guard_judge(g, step, loss, grad_norm), all = mine;
    if (comm != MPI_COMM_NULL) MT_CHECK_MPI(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MAX, comm));
    if (all == mine) return (enum step_verdict)all;
    /* another rank judged worse (its reduction rounded differently): count the step as it did */
    *g = before;
    snprintf(g->why, sizeof g->why, "step %d: another rank found the step bad (this rank: loss %g, "
             "gradient norm %g)", step, loss, grad_norm);
    g->consecutive++;
    g->total_skipped++;
    return all == STEP_STOP || g->consecutive >= g->max_skipped ? STEP_STOP : STEP_SKIP;
}

void step_guard_stop_message(const struct step_guard *g, char *buf, size_t cap)
{
    if (g->consecutive >= g->max_skipped)
        snprintf(buf, cap, "training stopped: %d steps in a row skipped (train.max_skipped_steps %d); "
                 "the last: %s; the newest checkpoint holds the last good weights", g->consecutive,
                 g->max_skipped, g->why);
    else
        snprintf(buf, cap, "training stopped (train.nonfinite: stop): %s; the newest checkpoint holds "
                 "the last good weights", g->why);
}
