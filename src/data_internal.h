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
/* allow_short: a file with fewer than seq_len tokens opens with no windows (a small last shard of a
 * dataset); otherwise it is an error. */
struct token_file *token_file_open(const char *path, int vocab, int seq_len, bool allow_short,
                                   char *err, int errcap);
void token_file_close(struct token_file *f);
bool token_file_sequence(const struct token_file *f, int64_t q, int32_t *out /* [seq_len] */,
                         char *err, int errcap);
int64_t token_file_count(const struct token_file *f);
int token_file_width(const struct token_file *f);
int64_t token_file_epoch_sequences(const struct token_file *f);
double token_file_unigram_entropy(const struct token_file *f);   /* NAN when not scanned */

/* Path lists (data_paths.c): spec is comma-separated items, each a token file, a directory (its
 * *.bin files) or a glob. Returns the sorted, de-duplicated files of each item in the items' order
 * (count in *n; free with data_paths_free), or NULL with a one-line reason naming the item. */
char **data_paths_expand(const char *spec, const char *key, int *n, char *err, int errcap);
void data_paths_free(char **paths, int n);

/* Seeded bijection of [0, n) (data_mix.c): a small Feistel network with cycle walking, so a
 * shuffled epoch needs no table. */
uint64_t data_permute(uint64_t i, uint64_t n, uint64_t key);
uint64_t data_mix64(uint64_t x);

/* One dataset: the windows of its files back to back, optionally permuted per epoch
 * (data_mix.c). */
struct dataset;
struct dataset *dataset_open(const char *spec, const char *key, int vocab, int seq_len,
                             bool shuffle, uint64_t shuffle_key, char *err, int errcap);
void dataset_close(struct dataset *ds);
bool dataset_sequence(const struct dataset *ds, int64_t local_q, int32_t *out /* [seq_len] */,
                      char *err, int errcap);
int64_t dataset_windows(const struct dataset *ds);   /* sequences per epoch */
int64_t dataset_tokens(const struct dataset *ds);
int dataset_files(const struct dataset *ds);
int dataset_width(const struct dataset *ds);          /* widest token of its files, bytes */
double dataset_unigram_entropy(const struct dataset *ds);  /* one scanned file, else NAN */

#endif
