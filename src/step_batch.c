/* One step's micro-batches for the training loop (step_batch.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "step_batch.h"

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
