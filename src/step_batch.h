/* What the training loop feeds the model from the data layer: one optimizer step's micro-batches
 * with their labels and document boundaries. */
#ifndef MT_STEP_BATCH_H
#define MT_STEP_BATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"
#include "config.h"
#include "data.h"
#include "model_step.h"

/* This rank's share of one step: n_micro micro-batches of mb sequences of S tokens. */
struct step_batch {
    int n_micro, mb, S;
    int dp_rank, dp_size;
    int eos_id;
    bool documents;             /* data.document_masking */
    bool loss_after_eos;
    int32_t *ids, *labels;      /* [n_micro, mb, S] */
    int32_t *pos, *seg;         /* [n_micro, mb, S] when documents, else NULL */
    int64_t n_valid_global;     /* labelled positions of the step over all data-parallel ranks */
};

void step_batch_init(struct step_batch *b, const struct data_config *d, int n_micro, int mb, int S,
                     int dp_rank, int dp_size);
void step_batch_free(struct step_batch *b);
/* Reads the micro-batches of optimizer step `step` (0-based global batch index) and counts the
 * step's labelled positions; with data.loss_after_eos: false that count depends on the data, so
 * it is summed over dp_comm (host, the ranks of one pipeline stage), which every rank of dp_comm
 * must call together. */
void step_batch_load(struct step_batch *b, const struct data_source *src, int64_t step,
                     struct comm *dp_comm);
/* Hands micro-batch `micro` to the model: sets its document boundaries (or clears them) and
 * runs model_forward with its ids and labels. */
void step_batch_forward(const struct step_batch *b, int micro, struct model *m,
                        struct model_step_out *out);

#endif
