/* The held-out validation pass (validation.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "pipeline_forward.h"
#include "route_replay.h"
#include "step_batch.h"
#include "validation.h"

struct validation {
    struct data_source *src;
    struct step_batch batch;
    int interval, batches;
    char desc[2 * MT_PATH_MAX + 512];
};

struct validation *validation_open(const struct config *c, int n_micro, int dp_rank, int dp_size)
{
    const struct data_config *d = &c->data;
    if (!d->validation_path[0]) return NULL;
    /* the held-out files read like training files, in file order, never blended */
    struct data_config vd = *d;
    mt_strlcpy(vd.path, d->validation_path, sizeof vd.path);
    vd.sources[0] = 0;
    vd.shuffle = false;
    char err[2 * MT_PATH_MAX];
    struct validation *v = mt_calloc(1, sizeof *v);
    v->src = data_open(&vd, &c->train, c->model.vocab_size, err, sizeof err);
    if (!v->src) {
        char *p = strstr(err, "data.path");   /* name the key the user set */
        if (p) mt_user_error("data.validation_path%s", p + strlen("data.path"));
        mt_user_error("data.validation_path: %s", err);
    }
    v->interval = d->validation_interval;
    v->batches = d->validation_batches;
    step_batch_init(&v->batch, d, n_micro, c->train.micro_batch_size, c->train.seq_len, dp_rank,
                    dp_size);
    const int64_t per_pass = (int64_t)v->batches * c->train.global_batch_size;
    const int64_t held = data_epoch_sequences(v->src);
    int n = snprintf(v->desc, sizeof v->desc, "every %d steps, %d batch(es) of %s", v->interval,
                     v->batches, data_describe(v->src));
    if (per_pass > held && n > 0 && n < (int)sizeof v->desc)
        snprintf(v->desc + n, sizeof v->desc - n, " (a pass reads %lld sequences, more than the %lld "
                 "held out: some count twice)", (long long)per_pass, (long long)held);
    return v;
}

void validation_close(struct validation *v)
{
    if (!v) return;
    data_close(v->src);
    step_batch_free(&v->batch);
    free(v);
}

bool validation_due(const struct validation *v, int step) { return v && step % v->interval == 0; }
const char *validation_describe(const struct validation *v) { return v->desc; }

double validation_run(struct validation *v, struct model *m, struct comm *dp_comm, struct comm *world,
                      struct comm *pp)
{
    double sums[2] = {0, 0};
    /* held-out sequences route on the model's own router: a routing replay file (data.routing_replay)
     * holds training sequences only */
    route_replay_pause(m, true);
    for (int b = 0; b < v->batches; b++) {
        step_batch_load(&v->batch, v->src, b, dp_comm);
        if (pp) {
            /* through the stages; the last one's CE and labelled count, 0 on the others */
            struct pipe_forward f = {.m = m, .pp = pp, .b = &v->batch};
            pipe_forward_run(&f);
            sums[0] += f.ce_sum;
            sums[1] += (double)f.n_valid;
        }
        for (int micro = 0; micro < v->batch.n_micro && !pp; micro++) {
            struct model_step_out o;
            step_batch_forward(&v->batch, micro, m, &o);
            sums[0] += o.ce_sum;
            sums[1] += (double)o.n_valid;
        }
    }
    route_replay_pause(m, false);
    comm_all_reduce_sum(world, sums, 2, COMM_F64);
    return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}
