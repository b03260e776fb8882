#include "run_notes.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "common.h"
#include "step_maths.h"

void run_note_resume(const char *dir, const struct config *c, int start_step)
{
    if (mt_rank() != 0) return;
    const struct train_config *now = &c->train;
    if (start_step >= now->steps) {
        mt_log0("resume: %s is at step %d and train.steps is %d: nothing left to train (raise train.steps "
                "to train on)\n", dir, start_step, now->steps);
        return;
    }
    struct config *old = mt_malloc(sizeof *old);
    char err[1024];
    if (ckpt_read_config(dir, 0, NULL, old, err, (int)sizeof err)) {
        const struct train_config *was = &old->train;
        char changed[512] = "";
        size_t n = 0;
#define CHANGED(cond, ...) \
    if (cond && n < sizeof changed) n += (size_t)snprintf(changed + n, sizeof changed - n, __VA_ARGS__)
        CHANGED(was->steps != now->steps, "%strain.steps %d -> %d", n ? ", " : "", was->steps, now->steps);
        CHANGED(was->warmup_steps != now->warmup_steps, "%swarmup_steps %d -> %d", n ? ", " : "",
                was->warmup_steps, now->warmup_steps);
        CHANGED(was->lr != now->lr, "%slr %.3g -> %.3g", n ? ", " : "", was->lr, now->lr);
        CHANGED(was->min_lr != now->min_lr, "%smin_lr %.3g -> %.3g", n ? ", " : "", was->min_lr, now->min_lr);
#undef CHANGED
        if (n)
            mt_log0("resume: the learning-rate schedule changed (%s): warmup and cosine decay are recomputed "
                    "for the new values, so step %d uses lr %.3g (the old schedule: %.3g)\n", changed,
                    start_step + 1, train_lr_at(now, start_step + 1), train_lr_at(was, start_step + 1));
    }
    free(old);
}

void run_note_done(const struct config *c, int start_step, double seconds)
{
    if (start_step >= c->train.steps)
        mt_log0("done: no step trained (the run was already at step %d of %d)\n", start_step, c->train.steps);
    else
        mt_log0("done: %d steps in %.1f s\n", c->train.steps - start_step, seconds);
}

void run_note_dry_run(const struct config *c)
{
    if (mt_rank() != 0 || c->data.kind != MT_DATA_TOKENS) return;
    struct stat st;
    if (stat(c->data.path, &st) != 0)
        mt_log0("note: data.path %s does not exist yet; --dry-run only lays out the ranks, train will "
                "need the token file\n", c->data.path);
}
