/* Datasets of several token files, and the seeded permutation that shuffles them (docs/data.md).
 *
 * A dataset's epoch is the windows of its files in file order (each file cut on its own, so no
 * sequence straddles two files). Local sequence i is window perm_e(i mod W) of epoch e = i div W,
 * where perm_e is the identity, or with shuffling a bijection of [0, W) keyed by (seed, dataset,
 * e): every window once per epoch, a different order each epoch, computed in O(1) without a table,
 * so sequence i stays a pure function of the config and i. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "data_internal.h"

uint64_t data_mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* A 4-round balanced Feistel network permutes [0, 4^h) for the smallest h with 4^h >= n; cycle
 * walking (re-applying it until the value lands below n) restricts it to a permutation of [0, n).
 * Because 4^h < 4n, the expected number of walks is below 4. */
uint64_t data_permute(uint64_t i, uint64_t n, uint64_t key)
{
    if (n <= 1) return 0;
    int bits = 64 - __builtin_clzll(n - 1);
    if (bits < 2) bits = 2;
    if (bits & 1) bits++;
    const int half = bits / 2;
    const uint64_t mask = (1ull << half) - 1;
    do {
        uint64_t l = i >> half, r = i & mask;
        for (uint64_t round = 0; round < 4; round++) {
            uint64_t t = l ^ (data_mix64(r ^ key ^ (round + 1) * 0xd6e8feb86659fd93ull) & mask);
            l = r;
            r = t;
        }
        i = l << half | r;
    } while (i >= n);
    return i;
}

struct dataset {
    int n_files;
    struct token_file **files;
    int64_t *first_window;   /* [n_files + 1] prefix sums of the files' windows */
    int64_t tokens;
    int width;
    bool shuffle;
    uint64_t key;
};

void dataset_close(struct dataset *ds)
{
    if (!ds) return;
    for (int i = 0; i < ds->n_files; i++) token_file_close(ds->files[i]);
    free(ds->files);
    free(ds->first_window);
    free(ds);
}

struct dataset *dataset_open(const char *spec, const char *key, int vocab, int seq_len,
                             bool shuffle, uint64_t shuffle_key, char *err, int errcap)
{
    int n = 0;
    char **paths = data_paths_expand(spec, key, &n, err, errcap);
    if (!paths) return NULL;
    struct dataset *ds = mt_calloc(1, sizeof *ds);
    ds->files = mt_calloc((size_t)n, sizeof *ds->files);
    ds->first_window = mt_calloc((size_t)n + 1, sizeof(int64_t));
    ds->shuffle = shuffle;
    ds->key = shuffle_key;
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        /* one file keeps the old rule (it must hold a sequence); among several, a short last
         * shard just contributes no window */
        ds->files[i] = token_file_open(paths[i], vocab, seq_len, n > 1, err, errcap);
        if (!ds->files[i]) {
            ok = false;
            break;
        }
        ds->n_files = i + 1;
        ds->first_window[i + 1] = ds->first_window[i] + token_file_epoch_sequences(ds->files[i]);
        ds->tokens += token_file_count(ds->files[i]);
        ds->width = MT_MAX(ds->width, token_file_width(ds->files[i]));
    }
    if (ok && ds->first_window[n] == 0) {
        snprintf(err, errcap, "%s: %s: %lld tokens in %d files, but no file holds one sequence of "
                 "train.seq_len %d", key, spec, (long long)ds->tokens, n, seq_len);
        ok = false;
    }
    data_paths_free(paths, n);
    if (!ok) {
        dataset_close(ds);
        return NULL;
    }
    return ds;
}

bool dataset_sequence(const struct dataset *ds, int64_t local_q, int32_t *out, char *err, int errcap)
{
    const int64_t W = ds->first_window[ds->n_files];
    const uint64_t epoch = (uint64_t)local_q / (uint64_t)W;
    uint64_t w = (uint64_t)local_q % (uint64_t)W;
    if (ds->shuffle) w = data_permute(w, (uint64_t)W, data_mix64(ds->key ^ data_mix64(epoch)));
    int lo = 0, hi = ds->n_files - 1;   /* the file f with first_window[f] <= w < first_window[f+1] */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ds->first_window[mid] <= (int64_t)w) lo = mid;
        else hi = mid - 1;
    }
    return token_file_sequence(ds->files[lo], (int64_t)w - ds->first_window[lo], out, err, errcap);
}

int64_t dataset_windows(const struct dataset *ds) { return ds->first_window[ds->n_files]; }
int64_t dataset_tokens(const struct dataset *ds) { return ds->tokens; }
int dataset_files(const struct dataset *ds) { return ds->n_files; }
int dataset_width(const struct dataset *ds) { return ds->width; }

double dataset_unigram_entropy(const struct dataset *ds)
{
    return ds->n_files == 1 ? token_file_unigram_entropy(ds->files[0]) : NAN;
}
