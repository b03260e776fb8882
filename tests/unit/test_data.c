/* Tests of the data layer: the synthetic chain (determinism, range, entropy rate against an empirical
 * estimate), the data-parallel slicing rule, token files (round trip, every rejected file) and the
 * make_tokens tool. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../test_util.h"
#include "common.h"
#include "config.h"
#include "data.h"

#define ERRCAP 2048

static struct data_source *open_synth(int vocab, int branching, uint64_t seed, int seq_len)
{
    struct data_config d = { .kind = MT_DATA_SYNTHETIC, .synthetic_branching = branching,
                             .synthetic_seed = seed };
    struct train_config t = { .seq_len = seq_len, .global_batch_size = 1, .micro_batch_size = 1,
                              .seed = 99 };
    char err[ERRCAP] = "";
    struct data_source *src = data_open(&d, &t, vocab, err, sizeof err);
    cr_assert(src, "data_open failed: %s", err);
    return src;
}

static struct data_source *open_tokens(const char *path, int vocab, int seq_len, char *err)
{
    struct data_config d = { .kind = MT_DATA_TOKENS };
    mt_strlcpy(d.path, path, sizeof d.path);
    struct train_config t = { .seq_len = seq_len, .global_batch_size = 1, .micro_batch_size = 1 };
    err[0] = 0;
    return data_open(&d, &t, vocab, err, ERRCAP);
}

static void make_tmpdir(char *dir /* [64] */)
{
    strcpy(dir, "/tmp/mt_test_data_XXXXXX");
    cr_assert(mkdtemp(dir), "mkdtemp failed");
}

static void remove_tree(const char *dir)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* ---------------- synthetic source ---------------- */

Test(data, synthetic_is_deterministic_and_random_access)
{
    const int V = 97, B = 3, T = 33, N = 40;
    struct data_source *a = open_synth(V, B, 7, T), *b = open_synth(V, B, 7, T);
    int32_t *x = mt_malloc(sizeof(int32_t) * N * T), *y = mt_malloc(sizeof(int32_t) * N * T);
    data_get_sequences(a, 0, N, x);
    data_get_sequences(b, 0, N, y);
    cr_assert(!memcmp(x, y, sizeof(int32_t) * N * T), "same config, different sequences");

    /* One at a time, in reverse order, from the other source: sequence q does not depend on how it
     * is asked for. */
    for (int q = N - 1; q >= 0; q--) {
        data_get_sequences(b, q, 1, y + q * T);
    }
    cr_assert(!memcmp(x, y, sizeof(int32_t) * N * T));
    data_get_sequences(a, 17, 5, y);
    cr_assert(!memcmp(x + 17 * T, y, sizeof(int32_t) * 5 * T));

    /* Consecutive sequences differ (they are independent walks, not one stream restarted). */
    cr_assert(memcmp(x, x + T, sizeof(int32_t) * T));

    /* Another data seed gives another corpus. */
    struct data_source *c = open_synth(V, B, 8, T);
    data_get_sequences(c, 0, N, y);
    cr_assert(memcmp(x, y, sizeof(int32_t) * N * T), "seed 7 and 8 gave the same data");
    cr_assert_neq(data_entropy_rate(a), data_entropy_rate(c));
    cr_assert_eq(data_entropy_rate(a), data_entropy_rate(b));
    cr_assert_eq(data_epoch_sequences(a), 0);
    cr_assert_eq(data_seq_len(a), T);
    data_close(a);
    data_close(b);
    data_close(c);
    free(x);
    free(y);
}

Test(data, synthetic_ignores_train_seed)
{
    struct data_config d = { .kind = MT_DATA_SYNTHETIC, .synthetic_branching = 4, .synthetic_seed = 3 };
    struct train_config t1 = { .seq_len = 16, .seed = 1 }, t2 = { .seq_len = 16, .seed = 2 };
    char err[ERRCAP];
    struct data_source *a = data_open(&d, &t1, 50, err, sizeof err), *b = data_open(&d, &t2, 50, err, sizeof err);
    cr_assert(a && b);
    int32_t x[4 * 16], y[4 * 16];
    data_get_sequences(a, 1000, 4, x);
    data_get_sequences(b, 1000, 4, y);
    cr_assert(!memcmp(x, y, sizeof x));
    data_close(a);
    data_close(b);
}

Test(data, synthetic_ids_below_vocab)
{
    const int sizes[][2] = { { 1, 1 }, { 2, 2 }, { 37, 5 }, { 300, 300 }, { 1000, 1 } };
    for (int k = 0; k < 5; k++) {
        int V = sizes[k][0], B = sizes[k][1], T = 64, N = 100;
        struct data_source *src = open_synth(V, B, 11 + k, T);
        int32_t *x = mt_malloc(sizeof(int32_t) * N * T);
        data_get_sequences(src, 123456789, N, x);
        for (int i = 0; i < N * T; i++)
            cr_assert(x[i] >= 0 && x[i] < V, "V=%d B=%d: id %d at %d", V, B, x[i], i);
        data_close(src);
        free(x);
    }
}

/* Branching 1 is a single cycle through the vocabulary: every token has exactly one successor, the
 * successor map is a permutation, and nothing is left to predict (entropy rate exactly 0). */
Test(data, synthetic_branching_one_is_a_cycle)
{
    const int V = 50, T = 200, N = 20;
    struct data_source *src = open_synth(V, 1, 5, T);
    cr_assert_eq(data_entropy_rate(src), 0.0);
    int32_t *x = mt_malloc(sizeof(int32_t) * N * T);
    data_get_sequences(src, 0, N, x);
    int next[50];
    for (int s = 0; s < V; s++) next[s] = -1;
    for (int q = 0; q < N; q++)
        for (int t = 0; t + 1 < T; t++) {
            int s = x[q * T + t], n = x[q * T + t + 1];
            cr_assert(next[s] < 0 || next[s] == n, "state %d has two successors", s);
            next[s] = n;
        }
    /* T-1 = 199 steps from any start visit the whole 50-cycle, so every state was seen. */
    int seen[50] = { 0 }, s = 0;
    for (int k = 0; k < V; k++) {
        cr_assert_geq(next[s], 0);
        cr_assert(!seen[s], "cycle shorter than the vocabulary");
        seen[s] = 1;
        s = next[s];
    }
    cr_assert_eq(s, 0);
    data_close(src);
    free(x);
}

/* The computed entropy rate H = sum_s pi(s) H(next|s) against the plug-in estimate from a long sample,
 * which needs neither the chain's tables nor its stationary distribution: counts n(s,t) of observed
 * transitions give H_hat = -sum n(s,t)/N log(n(s,t)/n(s)).
 * Tolerance: the plug-in estimate is biased low by about (K - V)/(2N) (K = observed transitions;
 * Miller-Madow), which we add back; its remaining error is about sd/sqrt(N), sd the sample standard
 * deviation of -log p_hat(t|s). Successive transitions of a fast-mixing chain are close to
 * uncorrelated, so 6 standard errors leaves no room for flakiness yet is ~0.005 nats here, far below
 * the change a wrong stationary distribution (e.g. uniform) makes. */
Test(data, synthetic_entropy_rate_matches_sample)
{
    const int V = 64, B = 4, T = 1024, N_SEQ = 1000;
    struct data_source *src = open_synth(V, B, 2024, T);
    double H = data_entropy_rate(src);
    cr_assert(H > 0 && H < log(B), "entropy rate %g outside (0, log %d)", H, B);

    int32_t *x = mt_malloc(sizeof(int32_t) * T * 100);
    double *n = mt_calloc(V * V, sizeof(double)), *ns = mt_calloc(V, sizeof(double));
    double N = 0;
    for (int q0 = 0; q0 < N_SEQ; q0 += 100) {
        data_get_sequences(src, q0, 100, x);
        for (int q = 0; q < 100; q++)
            for (int t = 0; t + 1 < T; t++) {
                n[x[q * T + t] * V + x[q * T + t + 1]] += 1;
                ns[x[q * T + t]] += 1;
                N += 1;
            }
    }
    double h = 0, h2 = 0;
    int K = 0, max_succ = 0;
    for (int s = 0; s < V; s++) {
        int succ = 0;
        for (int t = 0; t < V; t++) {
            double c = n[s * V + t];
            if (!c) continue;
            K++;
            succ++;
            double l = -log(c / ns[s]);
            h += c * l;
            h2 += c * l * l;
        }
        max_succ = MT_MAX(max_succ, succ);
    }
    h /= N;
    h2 /= N;
    cr_assert_leq(max_succ, B, "a state has more than %d successors", B);
    double corrected = h + (K - V) / (2 * N);
    double se = sqrt(h2 - h * h) / sqrt(N);
    cr_assert(fabs(corrected - H) < 6 * se, "sample entropy %.5f (plug-in %.5f), computed %.5f, 6 se %.5f",
              corrected, h, H, 6 * se);

    /* The first token comes from the stationary distribution: its histogram over many starts matches
     * the long-run state frequencies n(s)/N. With 50000 starts over 64 states the expected total
     * variation distance from sampling noise is about 0.4*sqrt(V/n) ~ 0.014; 0.04 is ~3x that. */
    const int STARTS = 50000;
    struct data_source *s2 = open_synth(V, B, 2024, 1);
    int32_t *first = mt_malloc(sizeof(int32_t) * STARTS);
    data_get_sequences(s2, 0, STARTS, first);
    double *f = mt_calloc(V, sizeof(double));
    for (int i = 0; i < STARTS; i++) f[first[i]] += 1.0 / STARTS;
    double tv = 0;
    for (int s = 0; s < V; s++) tv += 0.5 * fabs(f[s] - ns[s] / N);
    cr_assert_lt(tv, 0.04, "first-token distribution is %.4f (TV) from the long-run one", tv);

    data_close(src);
    data_close(s2);
    free(x);
    free(n);
    free(ns);
    free(first);
    free(f);
}

Test(data, synthetic_bad_config)
{
    struct data_config d = { .kind = MT_DATA_SYNTHETIC, .synthetic_branching = 0 };
    struct train_config t = { .seq_len = 8 };
    char err[ERRCAP];
    cr_assert_null(data_open(&d, &t, 10, err, sizeof err));
    cr_assert(strstr(err, "data.synthetic_branching 0"), "%s", err);
    d.synthetic_branching = 11;
    cr_assert_null(data_open(&d, &t, 10, err, sizeof err));
    cr_assert(strstr(err, "data.synthetic_branching 11"), "%s", err);
    d.synthetic_branching = 2;
    t.seq_len = 0;
    cr_assert_null(data_open(&d, &t, 10, err, sizeof err));
    cr_assert(strstr(err, "train.seq_len"), "%s", err);
    t.seq_len = 8;
    cr_assert_null(data_open(&d, &t, 0, err, sizeof err));
    cr_assert(strstr(err, "vocab_size"), "%s", err);
}

Test(data, describe_synthetic)
{
    struct data_source *src = open_synth(512, 4, 1, 8);
    char want[64];
    snprintf(want, sizeof want, "entropy rate %.4f nats/token", data_entropy_rate(src));
    const char *d = data_describe(src);
    cr_assert(strstr(d, "synthetic Markov chain: vocab 512, 4 successors/state"), "%s", d);
    cr_assert(strstr(d, want), "%s", d);
    cr_assert_null(strchr(d, '\n'));
    data_close(src);
}

/* ---------------- data-parallel slicing ---------------- */

/* Every (dp_size, n_micro, micro_batch) with the same product covers the step's global batch
 * [step*GB, (step+1)*GB) exactly once, and the sequences ranks read, put back in index order, are
 * the global batch read in one call. */
Test(data, dp_slices_cover_global_batch)
{
    const int GB = 24, T = 8;
    const int layouts[][3] = { /* dp_size, n_micro, micro_batch */
        { 1, 1, 24 }, { 1, 24, 1 }, { 2, 3, 4 }, { 3, 2, 4 }, { 4, 3, 2 }, { 6, 4, 1 }, { 8, 1, 3 },
        { 24, 1, 1 } };
    struct data_source *src = open_synth(40, 3, 9, T);
    int32_t whole[24 * 8], assembled[24 * 8], slice[24 * 8];
    for (int k = 0; k < 8; k++) {
        int dp = layouts[k][0], nm = layouts[k][1], mb = layouts[k][2];
        cr_assert_eq(data_micro_steps(GB, mb, dp), nm);
        for (int64_t step = 0; step < 5; step += 2) {
            int hits[24] = { 0 };
            data_get_sequences(src, step * GB, GB, whole);
            for (int r = 0; r < dp; r++)
                for (int m = 0; m < nm; m++) {
                    int64_t first = data_first_seq(step, m, nm, r, dp, mb);
                    cr_assert(first >= step * GB && first + mb <= (step + 1) * GB,
                              "dp %d m %d r %d: slice [%lld, +%d) outside step %lld", dp, m, r,
                              (long long)first, mb, (long long)step);
                    data_get_sequences(src, first, mb, slice);
                    for (int i = 0; i < mb; i++) {
                        int j = (int)(first - step * GB) + i;
                        cr_assert_eq(hits[j]++, 0, "sequence %d read twice", j);
                        memcpy(assembled + j * T, slice + i * T, sizeof(int32_t) * T);
                    }
                }
            for (int j = 0; j < GB; j++) cr_assert_eq(hits[j], 1, "sequence %d not read", j);
            cr_assert(!memcmp(whole, assembled, sizeof whole));
        }
    }
    data_close(src);
}

Test(data, micro_steps_rejects_uneven)
{
    cr_assert_eq(data_micro_steps(24, 5, 1), 0);
    cr_assert_eq(data_micro_steps(24, 4, 4), 0);
    cr_assert_eq(data_micro_steps(24, 0, 4), 0);
    cr_assert_eq(data_micro_steps(0, 1, 1), 0);
    cr_assert_eq(data_micro_steps(32, 2, 4), 4);
}

/* ---------------- token files ---------------- */

static void write_tokens(const char *path, int width, const uint32_t *tok, int64_t n)
{
    char err[ERRCAP];
    struct token_writer *w = token_writer_open(path, width, err, sizeof err);
    cr_assert(w, "%s", err);
    cr_assert(token_writer_put(w, tok, n / 2, err, sizeof err), "%s", err);
    cr_assert(token_writer_put(w, tok + n / 2, n - n / 2, err, sizeof err), "%s", err);
    cr_assert(token_writer_close(w, err, sizeof err), "%s", err);
}

static void round_trip(int width, int vocab)
{
    char dir[64], path[128];
    make_tmpdir(dir);
    snprintf(path, sizeof path, "%s/t.bin", dir);
    const int COUNT = 1000, T = 64, EPOCH = COUNT / T;   /* 15 windows, 40 tokens never used */
    uint32_t tok[1000];
    mt_rng r;
    mt_rng_seed(&r, (uint64_t)width);
    for (int i = 0; i < COUNT; i++) tok[i] = (uint32_t)(mt_rng_uniform(&r) * vocab);
    tok[7] = (uint32_t)vocab - 1;   /* the largest id survives */
    write_tokens(path, width, tok, COUNT);

    /* The bytes on disk, checked against the format in data.h by hand. */
    FILE *fp = fopen(path, "rb");
    cr_assert(fp);
    unsigned char raw[24 + 4 * 1000];
    size_t got = fread(raw, 1, sizeof raw, fp);
    fclose(fp);
    cr_assert_eq(got, 24 + (size_t)width * COUNT);
    cr_assert(!memcmp(raw, "MTTOKENS", 8));
    cr_assert(raw[8] == 1 && !raw[9] && !raw[10] && !raw[11]);
    cr_assert(raw[12] == width && !raw[13] && !raw[14] && !raw[15]);
    cr_assert(raw[16] == (COUNT & 0xff) && raw[17] == (COUNT >> 8) && !raw[18] && !raw[23]);
    for (int i = 0; i < COUNT; i++) {
        uint32_t v = 0;
        for (int b = width - 1; b >= 0; b--) v = v << 8 | raw[24 + width * i + b];
        cr_assert_eq(v, tok[i], "token %d on disk", i);
    }

    char err[ERRCAP];
    struct data_source *src = open_tokens(path, vocab, T, err);
    cr_assert(src, "%s", err);
    cr_assert_eq(data_epoch_sequences(src), EPOCH);
    cr_assert(strstr(data_describe(src), path));
    /* a file's entropy rate is unknown; its unigram entropy is reported as what it is */
    cr_assert(isnan(data_entropy_rate(src)));
    double h = data_unigram_entropy(src);
    cr_assert(h > 0 && h <= log(COUNT), "unigram entropy %g", h);
    cr_assert(strstr(data_describe(src), "unigram entropy") && !strstr(data_describe(src), "entropy rate"));
    /* Sequence q is window q mod 15; q = 15..44 are the second and third epochs. */
    int32_t x[45 * 64];
    data_get_sequences(src, 0, 45, x);
    for (int q = 0; q < 45; q++)
        for (int t = 0; t < T; t++)
            cr_assert_eq((uint32_t)x[q * T + t], tok[(q % EPOCH) * T + t], "q %d t %d", q, t);
    data_close(src);
    remove_tree(dir);
}

Test(data, token_file_round_trip_u16) { round_trip(2, 65536); }
Test(data, token_file_round_trip_u32) { round_trip(4, 200000); }

Test(data, token_writer_rejects_u16_overflow)
{
    char dir[64], path[128], err[ERRCAP];
    make_tmpdir(dir);
    snprintf(path, sizeof path, "%s/o.bin", dir);
    struct token_writer *w = token_writer_open(path, 2, err, sizeof err);
    cr_assert(w, "%s", err);
    uint32_t tok[3] = { 1, 70000, 2 };
    cr_assert(!token_writer_put(w, tok, 3, err, sizeof err));
    cr_assert(strstr(err, "70000") && strstr(err, path), "%s", err);
    token_writer_abort(w);
    cr_assert_neq(access(path, F_OK), 0, "aborted write left the file");
    remove_tree(dir);
}

/* A header: magic, version, dtype, count, little-endian. */
static void put_header(unsigned char *h, const char *magic, uint32_t version, uint32_t dtype, uint64_t count)
{
    memcpy(h, magic, 8);
    for (int i = 0; i < 4; i++) h[8 + i] = (unsigned char)(version >> 8 * i);
    for (int i = 0; i < 4; i++) h[12 + i] = (unsigned char)(dtype >> 8 * i);
    for (int i = 0; i < 8; i++) h[16 + i] = (unsigned char)(count >> 8 * i);
}

static void write_raw(const char *path, const void *bytes, size_t n)
{
    FILE *fp = fopen(path, "wb");
    cr_assert(fp);
    cr_assert_eq(fwrite(bytes, 1, n, fp), n);
    cr_assert_eq(fclose(fp), 0);
}

/* Opens `path` as a token file (vocab 50, seq_len 16) and expects a one-line error naming the file
 * and containing `want`. */
static void expect_error(const char *path, const char *want)
{
    char err[ERRCAP];
    struct data_source *src = open_tokens(path, 50, 16, err);
    cr_assert_null(src, "%s: opened, expected \"%s\"", path, want);
    cr_assert(strstr(err, path), "error does not name the file: %s", err);
    cr_assert(strstr(err, want), "expected \"%s\" in: %s", want, err);
    cr_assert_null(strchr(err, '\n'), "error is not one line: %s", err);
}

Test(data, token_file_errors)
{
    char dir[64], path[128];
    make_tmpdir(dir);
    unsigned char buf[24 + 2 * 300];
    memset(buf, 0, sizeof buf);   /* token id 0 everywhere: valid for vocab 50 */

    snprintf(path, sizeof path, "%s/missing.bin", dir);
    expect_error(path, "cannot open token file");

    snprintf(path, sizeof path, "%s/short.bin", dir);
    write_raw(path, "MTTOKENS\1\0", 10);
    expect_error(path, "shorter than the 24-byte header");

    snprintf(path, sizeof path, "%s/magic.bin", dir);
    put_header(buf, "MTTOKENZ", 1, 2, 100);
    write_raw(path, buf, 24 + 200);
    expect_error(path, "not a moetrain token file");

    snprintf(path, sizeof path, "%s/version.bin", dir);
    put_header(buf, "MTTOKENS", 2, 2, 100);
    write_raw(path, buf, 24 + 200);
    expect_error(path, "unsupported token file version 2");

    snprintf(path, sizeof path, "%s/dtype.bin", dir);
    put_header(buf, "MTTOKENS", 1, 3, 100);
    write_raw(path, buf, 24 + 300);
    expect_error(path, "unsupported token dtype 3");

    snprintf(path, sizeof path, "%s/truncated.bin", dir);
    put_header(buf, "MTTOKENS", 1, 2, 100);
    write_raw(path, buf, 24 + 199);
    expect_error(path, "truncated or trailing bytes");

    snprintf(path, sizeof path, "%s/trailing.bin", dir);
    write_raw(path, buf, 24 + 201);
    expect_error(path, "truncated or trailing bytes");

    snprintf(path, sizeof path, "%s/huge_count.bin", dir);
    put_header(buf, "MTTOKENS", 1, 4, UINT64_MAX / 2);
    write_raw(path, buf, 24 + 200);
    expect_error(path, "truncated or trailing bytes");

    snprintf(path, sizeof path, "%s/few.bin", dir);
    put_header(buf, "MTTOKENS", 1, 2, 15);   /* seq_len is 16 */
    write_raw(path, buf, 24 + 30);
    expect_error(path, "15 tokens, fewer than one sequence of train.seq_len 16");

    snprintf(path, sizeof path, "%s/badid.bin", dir);
    put_header(buf, "MTTOKENS", 1, 2, 100);
    buf[24 + 2 * 42] = 77;   /* token 42 = 77 >= vocab 50 */
    write_raw(path, buf, 24 + 200);
    expect_error(path, "token 42 has id 77 >= vocab_size 50");

    snprintf(path, sizeof path, "%s/badid_u32.bin", dir);
    memset(buf, 0, sizeof buf);
    put_header(buf, "MTTOKENS", 1, 4, 100);
    buf[24 + 4 * 99 + 2] = 1;   /* the last token = 65536 */
    write_raw(path, buf, 24 + 400);
    expect_error(path, "token 99 has id 65536 >= vocab_size 50");

    snprintf(path, sizeof path, "%s/dir.bin", dir);
    cr_assert_eq(mkdir(path, 0700), 0);
    expect_error(path, "has no *.bin token files");   /* a directory is a dataset of shards */
    expect_error("/dev/null", "not a regular file");

    struct data_config d = { .kind = MT_DATA_TOKENS };
    struct train_config t = { .seq_len = 16 };
    char err[ERRCAP];
    cr_assert_null(data_open(&d, &t, 50, err, sizeof err));
    cr_assert(strstr(err, "data.path is empty"), "%s", err);
    remove_tree(dir);
}

/* A file that changes after open (or a large file not scanned at open) is still checked on every
 * read: a bad id or a short read is an error naming the file, never an out-of-range id. */
Test(data, token_file_checked_on_read)
{
    char dir[64], path[128], err[ERRCAP];
    make_tmpdir(dir);
    snprintf(path, sizeof path, "%s/t.bin", dir);
    uint32_t tok[64];
    for (int i = 0; i < 64; i++) tok[i] = (uint32_t)(i % 50);
    write_tokens(path, 2, tok, 64);
    struct data_source *src = open_tokens(path, 50, 16, err);
    cr_assert(src, "%s", err);
    int32_t x[16];
    cr_assert(data_get_sequences_checked(src, 1, 1, x, err, sizeof err), "%s", err);
    cr_assert_eq(x[0], 16);

    int fd = open(path, O_WRONLY);
    cr_assert_geq(fd, 0);
    unsigned char bad[2] = { 200, 0 };
    cr_assert_eq(pwrite(fd, bad, 2, 24 + 2 * 21), 2);   /* token 21 = 200, inside window 1 */
    cr_assert(!data_get_sequences_checked(src, 5, 1, x, err, sizeof err));   /* 5 mod 4 = window 1 */
    cr_assert(strstr(err, path) && strstr(err, "token 21 has id 200 >= vocab_size 50"), "%s", err);
    cr_assert(data_get_sequences_checked(src, 0, 1, x, err, sizeof err), "%s", err);

    cr_assert_eq(ftruncate(fd, 24 + 2 * 40), 0);
    cr_assert_eq(close(fd), 0);
    cr_assert(!data_get_sequences_checked(src, 3, 1, x, err, sizeof err));
    cr_assert(strstr(err, path) && strstr(err, "unexpected end of file"), "%s", err);
    cr_assert(!data_get_sequences_checked(src, -1, 1, x, err, sizeof err));
    data_close(src);
    remove_tree(dir);
}

/* ---------------- tools/make_tokens ---------------- */

Test(data, make_tokens_from_text_and_synthetic)
{
    char tool[512];
    snprintf(tool, sizeof tool, "%s/tools/make_tokens", tu_build());
    if (access(tool, X_OK) != 0) cr_skip_test("%s not built", tool);
    char dir[64], txt[128], out[128], out2[128], cmd[1024], err[ERRCAP];
    make_tmpdir(dir);
    snprintf(txt, sizeof txt, "%s/in.txt", dir);
    snprintf(out, sizeof out, "%s/text.bin", dir);
    snprintf(out2, sizeof out2, "%s/synth.bin", dir);
    const char *text = "the quick brown fox jumps over the lazy dog, \xff\x01 twice over.";
    write_raw(txt, text, strlen(text));

    snprintf(cmd, sizeof cmd, "%s %s --vocab 256 --from-text %s", tool, out, txt);
    char *said = NULL;
    cr_assert_eq(tu_run(cmd, &said), 0, "%s", cmd);
    cr_expect(strstr(said, "unigram entropy"), "%s", said);   /* a small file is scanned at open */
    free(said);
    struct data_source *src = open_tokens(out, 256, (int)strlen(text), err);
    cr_assert(src, "%s", err);
    int32_t x[128];
    data_get_sequences(src, 0, 1, x);
    for (size_t i = 0; i < strlen(text); i++) cr_assert_eq(x[i], (unsigned char)text[i]);
    data_close(src);

    /* The synthetic file holds the source's walks of 4096 tokens back to back. */
    snprintf(cmd, sizeof cmd, "%s %s --vocab 300 --dtype u32 --synthetic 5000 --branching 3 --seed 4 > /dev/null",
             tool, out2);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    src = open_tokens(out2, 300, 904, err);   /* window 0 = the first 904 tokens of walk 0 */
    cr_assert(src, "%s", err);
    struct data_source *ref = open_synth(300, 3, 4, 904);
    int32_t *a = mt_malloc(sizeof(int32_t) * 904), *b = mt_malloc(sizeof(int32_t) * 904);
    data_get_sequences(src, 0, 1, a);
    data_get_sequences(ref, 0, 1, b);
    cr_assert(!memcmp(a, b, sizeof(int32_t) * 904), "first walk differs");
    data_close(src);
    data_close(ref);
    free(a);
    free(b);

    /* Bad usage: non-zero exit, nothing written. */
    snprintf(cmd, sizeof cmd, "%s %s/x.bin --vocab 100 --from-text %s 2> /dev/null", tool, dir, txt);
    cr_assert_neq(system(cmd), 0, "vocab 100 < 256 accepted for --from-text");
    snprintf(cmd, sizeof cmd, "%s %s/x.bin --vocab 70000 --dtype u16 --synthetic 10 2> /dev/null", tool, dir);
    cr_assert_neq(system(cmd), 0, "u16 with vocab 70000 accepted");
    snprintf(cmd, sizeof cmd, "%s/x.bin", dir);
    cr_assert_neq(access(cmd, F_OK), 0);
    remove_tree(dir);
}
