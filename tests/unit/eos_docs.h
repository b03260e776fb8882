/* A token file of documents for the data tests (test_train_data.c, test_pipeline_features.c):
 * documents of 3..40 tokens, each ending in `eos`, the others in [2, 420): a few cycles of a short
 * phrase with noise, so a model has something to learn across them. Deterministic per seed. */
#ifndef MT_TEST_EOS_DOCS_H
#define MT_TEST_EOS_DOCS_H

#include <criterion/criterion.h>
#include <stdint.h>

#include "common.h"
#include "data.h"

static inline void write_eos_docs(const char *path, uint64_t seed, int n_tokens, uint32_t eos)
{
    char err[1024];
    struct token_writer *w = token_writer_open(path, 2, err, sizeof err);
    cr_assert(w, "%s", err);
    mt_rng rng;
    mt_rng_seed(&rng, seed);
    int left = 0;
    for (int i = 0; i < n_tokens; i++) {
        uint32_t v;
        if (left == 0) left = 3 + (int)(mt_rng_next(&rng) % 38);
        if (--left == 0) v = eos;
        else v = 2 + (uint32_t)((i % 7) * 60 + mt_rng_next(&rng) % 3);
        cr_assert(token_writer_put(w, &v, 1, err, sizeof err), "%s", err);
    }
    cr_assert(token_writer_close(w, err, sizeof err), "%s", err);
}

#endif
