/* The data source front: opens the configured kind, hands out sequences by global index, and the
 * slicing rule that gives every data-parallel rank its share of a step (data.h, docs/data.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "data.h"
#include "data_internal.h"
#include "ops.h"

/* Blending: a block of BLEND_BLOCK consecutive sequences holds count[i] sequences of source i
 * (weights apportioned by largest remainder), interleaved by smooth weighted round-robin, so every
 * stretch of sequences, and so every global batch, has close to the weighted mix. */
#define BLEND_BLOCK 4096

struct data_source {
    enum mt_data_kind kind;
    int seq_len;
    int vocab;
    struct synth_chain *chain;   /* kind synthetic */
    int n_sets;                  /* kind tokens: datasets opened so far (1 without data.sources) */
    int n_specs;                 /* entries of specs */
    struct dataset **sets;       /* [n_sets] */
    double *weights;             /* [n_sets] as configured */
    char **specs;                /* [n_sets] each dataset's path list, for the description */
    int block;                   /* sequences per blend block (1 for a single dataset) */
    int *count;                  /* [n_sets] sequences of each dataset per block */
    int *slot_set;               /* [block] the dataset of each slot */
    int *slot_rank;              /* [block] how many earlier slots of the block share its dataset */
    char desc[2 * MT_PATH_MAX + 512];
};

/* "PATH:WEIGHT,..." into paths and weights; the weight follows the last ':'. */
static bool parse_sources(const char *spec, char ***paths, double **weights, int *n, char *err,
                          int errcap)
{
    int cap = 1;
    for (const char *p = spec; *p; p++) cap += *p == ',';
    *paths = mt_calloc((size_t)cap, sizeof **paths);
    *weights = mt_calloc((size_t)cap, sizeof **weights);
    *n = 0;
    char item[MT_PATH_MAX];
    for (const char *p = spec;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len >= sizeof item) len = sizeof item - 1;
        memcpy(item, p, len);
        item[len] = 0;
        char *colon = strrchr(item, ':'), *end = NULL;
        double w = colon ? strtod(colon + 1, &end) : NAN;
        if (!colon || end == colon + 1 || *end || !(w > 0) || !isfinite(w)) {
            snprintf(err, errcap, "data.sources: '%s' is not PATH:WEIGHT with a positive weight "
                     "(YAML: data.sources: [{path: FILES, weight: W}, ...])", item);
            return false;
        }
        *colon = 0;
        (*paths)[*n] = mt_strdup(item);
        (*weights)[(*n)++] = w;
        if (!comma) return true;
        p = comma + 1;
    }
}

static bool build_blend(struct data_source *src, char *err, int errcap)
{
    const int n = src->n_sets;
    src->block = n == 1 ? 1 : BLEND_BLOCK;
    src->count = mt_calloc((size_t)n, sizeof(int));
    src->slot_set = mt_calloc((size_t)src->block, sizeof(int));
    src->slot_rank = mt_calloc((size_t)src->block, sizeof(int));
    double total = 0;
    for (int i = 0; i < n; i++) total += src->weights[i];
    int given = 0;
    double *rem = mt_calloc((size_t)n, sizeof(double));
    for (int i = 0; i < n; i++) {
        double exact = src->weights[i] / total * src->block;
        src->count[i] = (int)floor(exact);
        rem[i] = exact - src->count[i];
        given += src->count[i];
    }
    for (; given < src->block; given++) {   /* largest remainders, ties to the earlier source */
        int best = 0;
        for (int i = 1; i < n; i++)
            if (rem[i] > rem[best]) best = i;
        src->count[best]++;
        rem[best] = -1;
    }
    free(rem);
    for (int i = 0; i < n; i++)
        if (src->count[i] == 0) {
            snprintf(err, errcap, "data.sources: source %d has weight %g, under 1/%d of the total "
                     "%g: it would get no sequences", i + 1, src->weights[i], src->block, total);
            return false;
        }
    int64_t *cur = mt_calloc((size_t)n, sizeof(int64_t));
    int *used = mt_calloc((size_t)n, sizeof(int));
    for (int j = 0; j < src->block; j++) {
        int best = 0;
        for (int i = 0; i < n; i++) {
            cur[i] += src->count[i];
            if (cur[i] > cur[best]) best = i;
        }
        cur[best] -= src->block;
        src->slot_set[j] = best;
        src->slot_rank[j] = used[best]++;
    }
    free(cur);
    free(used);
    return true;
}

static void describe_tokens(struct data_source *src, const struct data_config *d, int seq_len)
{
    char *p = src->desc;
    size_t cap = sizeof src->desc;
    int k = 0;
#define PUT(...) (k = snprintf(p, cap, __VA_ARGS__), p += (k > 0 && (size_t)k < cap) ? k : 0, \
                  cap -= (k > 0 && (size_t)k < cap) ? (size_t)k : 0)
    if (src->n_sets > 1) PUT("blend of %d token datasets:", src->n_sets);
    for (int i = 0; i < src->n_sets; i++) {
        const struct dataset *ds = src->sets[i];
        if (src->n_sets > 1)
            PUT(" [%d] weight %g (%d/%d of sequences) ", i + 1, src->weights[i], src->count[i],
                src->block);
        else
            PUT("token files ");
        PUT("%s: %lld tokens in %d file(s) (uint%d), %lld sequences of %d per epoch", src->specs[i],
            (long long)dataset_tokens(ds), dataset_files(ds), 8 * dataset_width(ds),
            (long long)dataset_windows(ds), seq_len);
        double h = dataset_unigram_entropy(ds);
        if (!isnan(h))
            PUT(", unigram entropy %.4f nats/token (the loss of a model that ignores context, not a "
                "bound on the best loss)", h);
    }
    PUT("%s", d->shuffle ? "; shuffled" : "; in file order");
    if (d->shuffle) PUT(" (data.seed %llu)", (unsigned long long)d->seed);
    if (d->document_masking) PUT("; document masking after eos %d", d->eos_id);
    if (!d->loss_after_eos && d->eos_id >= 0) PUT("; no loss on the token after eos %d", d->eos_id);
#undef PUT
}

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
    case MT_DATA_TOKENS: {
        if (!d->path[0] && !d->sources[0]) {
            snprintf(err, errcap, "data.path is empty: data.kind tokens needs token files "
                     "(tools/prepare_data.py or tools/make_tokens writes them)");
            break;
        }
        char **paths = NULL;
        int n = 0;
        if (d->sources[0]) {
            if (!parse_sources(d->sources, &paths, &src->weights, &n, err, errcap)) {
                data_paths_free(paths, n);
                break;
            }
            if (n > BLEND_BLOCK) {
                snprintf(err, errcap, "data.sources: %d sources, more than %d", n, BLEND_BLOCK);
                data_paths_free(paths, n);
                break;
            }
        } else {
            paths = mt_calloc(1, sizeof *paths);
            paths[0] = mt_strdup(d->path);
            src->weights = mt_calloc(1, sizeof(double));
            src->weights[0] = 1.0;
            n = 1;
        }
        src->sets = mt_calloc((size_t)n, sizeof *src->sets);
        src->specs = paths;   /* freed by data_close */
        src->n_specs = n;
        bool ok = true;
        for (int i = 0; i < n && ok; i++) {
            char key[48];
            snprintf(key, sizeof key, d->sources[0] ? "data.sources[%d]" : "data.path", i + 1);
            src->sets[i] = dataset_open(paths[i], key, vocab_size, t->seq_len, d->shuffle,
                                        data_mix64(d->seed ^ data_mix64((uint64_t)i + 1)), err,
                                        errcap);
            ok = src->sets[i] != NULL;
            src->n_sets = ok ? i + 1 : i;
        }
        if (!ok || !build_blend(src, err, errcap)) break;
        describe_tokens(src, d, t->seq_len);
        return src;
    }
    default:
        snprintf(err, errcap, "data.kind %d is not synthetic or tokens", (int)d->kind);
        break;
    }
    data_close(src);
    return NULL;
}

void data_close(struct data_source *src)
{
    if (!src) return;
    synth_chain_free(src->chain);
    for (int i = 0; i < src->n_sets; i++) dataset_close(src->sets[i]);
    free(src->sets);
    free(src->weights);
    data_paths_free(src->specs, src->n_specs);
    free(src->count);
    free(src->slot_set);
    free(src->slot_rank);
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
        const int64_t q = first_seq + i;
        if (src->kind == MT_DATA_SYNTHETIC) {
            synth_chain_sequence(src->chain, q, src->seq_len, row);
            continue;
        }
        const int64_t blk = q / src->block;
        const int j = (int)(q - blk * src->block), set = src->slot_set[j];
        if (!dataset_sequence(src->sets[set], blk * src->count[set] + src->slot_rank[j], row, err,
                              errcap))
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
    return src->kind == MT_DATA_SYNTHETIC ? synth_chain_entropy_rate(src->chain) : NAN;
}

double data_unigram_entropy(const struct data_source *src)
{
    return src->kind == MT_DATA_TOKENS && src->n_sets == 1 ? dataset_unigram_entropy(src->sets[0])
                                                           : NAN;
}

const char *data_describe(const struct data_source *src) { return src->desc; }
int data_seq_len(const struct data_source *src) { return src->seq_len; }

int64_t data_epoch_sequences(const struct data_source *src)
{
    return src->kind == MT_DATA_TOKENS && src->n_sets == 1 ? dataset_windows(src->sets[0]) : 0;
}

void data_documents(int eos_id, const int32_t *ids, int n_seq, int seq_len, int32_t *pos,
                    int32_t *seg)
{
    for (int i = 0; i < n_seq; i++) {
        const int32_t *row = ids + (size_t)i * seq_len;
        int32_t doc = 0, start = 0;
        for (int t = 0; t < seq_len; t++) {
            if (t > 0 && row[t - 1] == eos_id) doc++, start = t;
            pos[(size_t)i * seq_len + t] = t - start;
            seg[(size_t)i * seq_len + t] = doc;
        }
    }
}

int64_t data_labels(int eos_id, bool loss_after_eos, const int32_t *ids, int n_seq, int seq_len,
                    int32_t *labels)
{
    int64_t n_valid = 0;
    for (int i = 0; i < n_seq; i++) {
        const size_t r = (size_t)i * seq_len;
        for (int t = 0; t < seq_len; t++) {
            const bool drop = !loss_after_eos && t > 0 && ids[r + t - 1] == eos_id;
            labels[r + t] = drop ? MT_IGNORE_INDEX : ids[r + t];
            n_valid += t > 0 && !drop;   /* position t-1 predicts label t */
        }
    }
    return n_valid;
}
