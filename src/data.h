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
 *  - tokens: files "MTTOKENS" v1 (header below), each cut into consecutive windows of seq_len tokens
 *    (leftover tokens, count % seq_len, are never used). A dataset is data.path's files (a
 *    comma-separated list of files, directories and globs) back to back; its windows repeat in
 *    epochs, in file order or permuted per epoch (data.shuffle, data.seed). data.sources blends
 *    several datasets by weight. All of it is computed per sequence index, without state. */
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
 * Token files: NAN (their entropy rate is unknown). */
double data_entropy_rate(const struct data_source *src);
/* Token files of one dataset in one file scanned at open (small files): the unigram entropy, the
 * loss of the best model that ignores context (real models go below it). Else NAN. */
double data_unigram_entropy(const struct data_source *src);

/* Document boundaries of packed sequences: a document starts at the token after eos_id (and at
 * each sequence start). pos [n_seq, seq_len]: position inside the document; seg: document number
 * inside the sequence (0, 1, ...). */
void data_documents(int eos_id, const int32_t *ids, int n_seq, int seq_len, int32_t *pos,
                    int32_t *seg);
/* labels [n_seq, seq_len] = ids, except MT_IGNORE_INDEX for a token right after eos_id when
 * loss_after_eos is false (no loss on guessing the next document's first token). Returns the
 * labelled positions (the model predicts label t from position t-1, so t = 0 never counts). */
int64_t data_labels(int eos_id, bool loss_after_eos, const int32_t *ids, int n_seq, int seq_len,
                    int32_t *labels);
/* One line for the start-up table, e.g.
 * "synthetic Markov chain: vocab 512, 4 successors/state, seed 1, entropy rate 1.23 nats/token". */
const char *data_describe(const struct data_source *src);
int data_seq_len(const struct data_source *src);
/* Sequences per epoch of a single token dataset; 0 for the synthetic source and blends. */
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
