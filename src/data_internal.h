/* Shared between data.c (the public front), data_synthetic.c and data_tokens.c. Not for other modules:
 * they use data.h. */
#ifndef MT_DATA_INTERNAL_H
#define MT_DATA_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

/* Synthetic Markov chain (data_synthetic.c). */
struct synth_chain;
struct synth_chain *synth_chain_build(int vocab, int branching, uint64_t seed, char *err, int errcap);
void synth_chain_free(struct synth_chain *c);
double synth_chain_entropy_rate(const struct synth_chain *c);
/* Sequence q: first token from the stationary distribution, then seq_len-1 chain steps, all drawn
 * from an RNG seeded by (seed, q) alone. */
void synth_chain_sequence(const struct synth_chain *c, int64_t q, int seq_len,
                          int32_t *out /* [seq_len] */);

/* Token file reader (data_tokens.c). */
struct token_file;
struct token_file *token_file_open(const char *path, int vocab, int seq_len, char *err, int errcap);
void token_file_close(struct token_file *f);
bool token_file_sequence(const struct token_file *f, int64_t q, int32_t *out /* [seq_len] */,
                         char *err, int errcap);
int64_t token_file_count(const struct token_file *f);
int token_file_width(const struct token_file *f);
int64_t token_file_epoch_sequences(const struct token_file *f);
double token_file_unigram_entropy(const struct token_file *f);   /* NAN when not scanned */

#endif
