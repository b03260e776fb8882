/* The data source front: opens the configured kind, hands out sequences by global index, and the
 * slicing rule that gives every data-parallel rank its share of a step (data.h, docs/data.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "data.h"
#include "data_internal.h"

struct data_source {
    enum mt_data_kind kind;
    int seq_len;
    int vocab;
    struct synth_chain *chain;   /* kind synthetic */
    struct token_file *file;     /* kind tokens */
    char desc[MT_PATH_MAX + 256];
};

struct data_source *data_open(const struct data_config *d, const struct train_config *t,
                              int vocab_size, char *err, int errcap)
{
    if (t->seq_len < 1) {
        snprintf(err, errcap, "train.seq_len %d must be positive", t->seq_len);
        return NULL;
    }
    if (vocab_size < 1) {
        snprintf(err, errcap, "model.vocab_size %d must be positive", vocab_size);
        return NULL;
    }
    struct data_source *src = mt_calloc(1, sizeof *src);
    src->kind = d->kind;
    src->seq_len = t->seq_len;
    src->vocab = vocab_size;
    switch (d->kind) {
    case MT_DATA_SYNTHETIC:
        src->chain = synth_chain_build(vocab_size, d->synthetic_branching, d->synthetic_seed, err, errcap);
        if (!src->chain) break;
        snprintf(src->desc, sizeof src->desc,
                 "synthetic Markov chain: vocab %d, %d successors/state, seed %llu, entropy rate %.4f "
                 "nats/token", vocab_size, d->synthetic_branching,
                 (unsigned long long)d->synthetic_seed, synth_chain_entropy_rate(src->chain));
        return src;
    case MT_DATA_TOKENS:
        if (!d->path[0]) {
            snprintf(err, errcap, "data.path is empty: data.kind tokens needs a token file "
                     "(tools/make_tokens writes one)");
            break;
        }
        src->file = token_file_open(d->path, vocab_size, t->seq_len, err, errcap);
        if (!src->file) break;
        {
            int n = snprintf(src->desc, sizeof src->desc,
                             "token file %s: %lld tokens (uint%d), %lld sequences of %d per epoch",
                             d->path, (long long)token_file_count(src->file),
                             8 * token_file_width(src->file),
                             (long long)token_file_epoch_sequences(src->file), t->seq_len);
            double h = token_file_unigram_entropy(src->file);
            if (!isnan(h) && n > 0 && n < (int)sizeof src->desc)
                snprintf(src->desc + n, sizeof src->desc - n, ", unigram entropy %.4f nats/token", h);
        }
        return src;
    default:
        snprintf(err, errcap, "data.kind %d is not synthetic or tokens", (int)d->kind);
        break;
    }
    free(src);
    return NULL;
}

void data_close(struct data_source *src)
{
    if (!src) return;
    synth_chain_free(src->chain);
    token_file_close(src->file);
    free(src);
}

bool data_get_sequences_checked(const struct data_source *src, int64_t first_seq, int n_seq,
                                int32_t *ids, char *err, int errcap)
{
    if (first_seq < 0 || n_seq < 0 || first_seq > INT64_MAX - n_seq) {
        snprintf(err, errcap, "data: sequences [%lld, +%d) out of range", (long long)first_seq, n_seq);
        return false;
    }
    for (int i = 0; i < n_seq; i++) {
        int32_t *row = ids + (int64_t)i * src->seq_len;
        if (src->kind == MT_DATA_SYNTHETIC)
            synth_chain_sequence(src->chain, first_seq + i, src->seq_len, row);
        else if (!token_file_sequence(src->file, first_seq + i, row, err, errcap))
            return false;
    }
    return true;
}

void data_get_sequences(const struct data_source *src, int64_t first_seq, int n_seq, int32_t *ids)
{
    char err[MT_PATH_MAX + 256];
    if (!data_get_sequences_checked(src, first_seq, n_seq, ids, err, sizeof err))
        mt_fatal("%s", err);
}

int64_t data_first_seq(int64_t step, int micro_step, int n_micro, int dp_rank, int dp_size,
                       int micro_batch)
{
    int64_t global_batch = (int64_t)n_micro * dp_size * micro_batch;
    return step * global_batch + ((int64_t)micro_step * dp_size + dp_rank) * micro_batch;
}

int data_micro_steps(int global_batch, int micro_batch, int dp_size)
{
    if (global_batch < 1 || micro_batch < 1 || dp_size < 1) return 0;
    int64_t per = (int64_t)micro_batch * dp_size;
    return global_batch % per ? 0 : (int)(global_batch / per);
}

double data_entropy_rate(const struct data_source *src)
{
    return src->kind == MT_DATA_SYNTHETIC ? synth_chain_entropy_rate(src->chain)
                                          : token_file_unigram_entropy(src->file);
}

const char *data_describe(const struct data_source *src) { return src->desc; }
int data_seq_len(const struct data_source *src) { return src->seq_len; }

int64_t data_epoch_sequences(const struct data_source *src)
{
    return src->kind == MT_DATA_TOKENS ? token_file_epoch_sequences(src->file) : 0;
}
