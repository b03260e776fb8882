/* Training data: a random-access stream of token sequences that is a deterministic function of the
 * config and the global sequence index, independent of the mesh (docs/data.md).
 *
 * Numbering. Every sequence has a global index q. Step s uses q in [s*GB, (s+1)*GB) with
 * GB = train.global_batch_size = n_micro * dp_size * micro_batch. Micro-step m of data-parallel rank r
 * (the rank's index inside its pipeline stage, design.md "Data") reads the contiguous slice
 * [s*GB + (m*dp_size + r)*micro_batch, +micro_batch) -- see data_first_seq. The stages of one
 * pipeline share r and so read the same slice. Because access is random and stateless, the position
 * in the stream that a checkpoint must record is just the step.
 *
 * Sequences are seq_len token ids. Labels are the ids themselves, as in transformers: the loss shifts
 * them (position t predicts token t+1; the last position has no label).
 *
 * Sources:
 *  - synthetic: a sparse random Markov chain over the vocabulary with a known entropy rate, which is
 *    the best mean cross-entropy per labelled position any model can reach on it.
 *  - tokens: a file "MTTOKENS" v1 (header below) cut into consecutive windows of seq_len tokens that
 *    wrap around at the end (epochs); leftover tokens (count % seq_len) are never used. */
#ifndef MT_DATA_H
#define MT_DATA_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"

struct data_source;

/* Opens the source described by d for sequences of t->seq_len tokens whose ids must be < vocab_size.
 * The synthetic chain depends on d->synthetic_seed only (not on t->seed), so changing the model seed
 * keeps the data. Returns NULL with a one-line reason in err (naming the file for token files). */
struct data_source *data_open(const struct data_config *d, const struct train_config *t,
                              int vocab_size, char *err, int errcap);
void data_close(struct data_source *src);

/* Writes sequences q = first_seq .. first_seq+n_seq-1 into ids [n_seq, seq_len]. Sequence q is the
 * same whichever call and whichever rank asks for it. Safe to call from several threads at once.
 * A read error or a token id >= vocab_size (checked on every read) is mt_fatal naming the file, the
 * token position and the value. */
void data_get_sequences(const struct data_source *src, int64_t first_seq, int n_seq,
                        int32_t *ids /* [n_seq, seq_len] */);
/* The same, returning false with a one-line reason in err instead of aborting. */
bool data_get_sequences_checked(const struct data_source *src, int64_t first_seq, int n_seq,
                                int32_t *ids /* [n_seq, seq_len] */, char *err, int errcap);

/* First global sequence index of micro-step micro_step (0..n_micro-1) of data-parallel rank dp_rank
 * (0..dp_size-1) at optimizer step `step`; the rank reads micro_batch sequences from there:
 *   step * (n_micro*dp_size*micro_batch) + (micro_step*dp_size + dp_rank) * micro_batch. */
int64_t data_first_seq(int64_t step, int micro_step, int n_micro, int dp_rank, int dp_size,
                       int micro_batch);
/* Micro-steps per optimizer step, global_batch / (dp_size * micro_batch); 0 when that does not
 * divide evenly or an argument is not positive. */
int data_micro_steps(int global_batch, int micro_batch, int dp_size);

/* Nats per token. Synthetic: the chain's entropy rate H = sum_s pi(s) H(next | s), the lower bound
 * of the expected loss at every labelled position (sequences start in the stationary distribution).
 * Token files: the unigram entropy of the file when it was scanned at open (small files), else NAN. */
double data_entropy_rate(const struct data_source *src);
/* One line for the start-up table, e.g.
 * "synthetic Markov chain: vocab 512, 4 successors/state, seed 1, entropy rate 1.23 nats/token". */
const char *data_describe(const struct data_source *src);
int data_seq_len(const struct data_source *src);
/* Sequences per pass over a token file; 0 for the endless synthetic source. */
int64_t data_epoch_sequences(const struct data_source *src);

/* Token files (little-endian):
 *   bytes 0..7   magic "MTTOKENS"
 *   bytes 8..11  u32 version (1)
 *   bytes 12..15 u32 dtype = byte width of a token: 2 (uint16) or 4 (uint32)
 *   bytes 16..23 u64 count of tokens
 *   then count tokens of that width. The file size must be exactly 24 + count*width. */
#define MT_TOKENS_MAGIC "MTTOKENS"
#define MT_TOKENS_VERSION 1u
#define MT_TOKENS_HEADER_BYTES 24

/* Streaming writer. It writes PATH.tmp and renames it to PATH on close, so a failed or interrupted
 * write never leaves a file that looks whole. Every function returns false / NULL with a one-line
 * reason naming the file; after a failure call token_writer_abort. */
struct token_writer;
struct token_writer *token_writer_open(const char *path, int width /* 2 or 4 */, char *err,
                                       int errcap);
bool token_writer_put(struct token_writer *w, const uint32_t *tokens, int64_t n, char *err,
                      int errcap);
bool token_writer_close(struct token_writer *w, char *err, int errcap);
void token_writer_abort(struct token_writer *w);   /* removes PATH.tmp, frees w */

#endif
