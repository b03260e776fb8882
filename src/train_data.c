/* Step batches and validation for the training loop (train_data.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "pipeline_forward.h"
#include "route_replay.h"
#include "train_data.h"

void step_batch_init(struct step_batch *b, const struct data_config *d, int n_micro, int mb, int S,
                     int dp_rank, int dp_size)
{
    memset(b, 0, sizeof *b);
    b->n_micro = n_micro, b->mb = mb, b->S = S;
    b->dp_rank = dp_rank, b->dp_size = dp_size;
    b->eos_id = d->eos_id;
    b->documents = d->document_masking;
    b->loss_after_eos = d->loss_after_eos;
    const size_t n = (size_t)n_micro * mb * S;
    b->ids = mt_malloc(n * sizeof(int32_t));
    b->labels = mt_malloc(n * sizeof(int32_t));
    if (b->documents) {
        b->pos = mt_malloc(n * sizeof(int32_t));
        b->seg = mt_malloc(n * sizeof(int32_t));
    }
}

void step_batch_free(struct step_batch *b)
{
    free(b->ids), free(b->labels), free(b->pos), free(b->seg);
    memset(b, 0, sizeof *b);
}

void step_batch_load(struct step_batch *b, const struct data_source *src, int64_t step,
                     struct comm *dp_comm)
{
    const size_t per = (size_t)b->mb * b->S;
    int64_t local = 0;
    for (int micro = 0; micro < b->n_micro; micro++) {
        int32_t *ids = b->ids + micro * per;
        data_get_sequences(src, data_first_seq(step, micro, b->n_micro, b->dp_rank, b->dp_size, b->mb),
                           b->mb, ids);
        local += data_labels(b->eos_id, b->loss_after_eos, ids, b->mb, b->S, b->labels + micro * per);
        if (b->documents) data_documents(b->eos_id, ids, b->mb, b->S, b->pos + micro * per,
                                         b->seg + micro * per);
    }
    if (b->loss_after_eos) {   /* every position but the last of each sequence is labelled */
        b->n_valid_global = (int64_t)b->n_micro * b->dp_size * b->mb * (b->S - 1);
        return;
    }
    double sum = (double)local;   /* exact: counts stay far below 2^53 */
    comm_all_reduce_sum(dp_comm, &sum, 1, COMM_F64);
    b->n_valid_global = (int64_t)sum;
}

void step_batch_forward(const struct step_batch *b, int micro, struct model *m,
                        struct model_step_out *out)
{
    const size_t at = (size_t)micro * b->mb * b->S;
    if (b->documents) model_set_documents(m, 0, b->pos + at, b->seg + at);   /* model_forward: slot 0 */
    else model_set_documents(m, 0, NULL, NULL);
    model_forward(m, b->ids + at, b->labels + at, out);
}

/* ---- validation ---- */

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
