/* Tests of datasets of several files, shuffling, blending by weight and document boundaries
 * (src/data_mix.c, src/data_paths.c, src/data.c). Windows are made recognisable: every token of
 * window w of file f is 1 + 100 f + w, so a sequence's first token says where it came from. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "config.h"
#include "data.h"
#include "data_internal.h"
#include "ops.h"

#define ERRCAP 2048
enum { SL = 4, VOCAB = 1000 };

static void make_tmpdir(char *dir /* [64] */)
{
    strcpy(dir, "/tmp/mt_test_mix_XXXXXX");
    cr_assert(mkdtemp(dir), "mkdtemp failed");
}

static void remove_tree(const char *dir)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* File f with `windows` windows of SL tokens plus `extra` leftover tokens. */
static void write_file(const char *path, int f, int windows, int extra)
{
    char err[ERRCAP];
    struct token_writer *w = token_writer_open(path, 2, err, sizeof err);
    cr_assert(w, "%s", err);
    for (int i = 0; i < windows * SL + extra; i++) {
        uint32_t v = (uint32_t)(1 + 100 * f + i / SL);
        cr_assert(token_writer_put(w, &v, 1, err, sizeof err), "%s", err);
    }
    cr_assert(token_writer_close(w, err, sizeof err), "%s", err);
}

static struct data_source *open_cfg(const struct data_config *d, char *err)
{
    struct train_config t = { .seq_len = SL, .global_batch_size = 1, .micro_batch_size = 1 };
    err[0] = 0;
    return data_open(d, &t, VOCAB, err, ERRCAP);
}

static struct data_source *open_path(const char *path, bool shuffle, uint64_t seed, char *err)
{
    struct data_config d = { .kind = MT_DATA_TOKENS, .shuffle = shuffle, .seed = seed, .eos_id = -1,
                             .loss_after_eos = true };
    mt_strlcpy(d.path, path, sizeof d.path);
    return open_cfg(&d, err);
}

/* First token of each of sequences [0, n). */
static void heads(const struct data_source *src, int n, int32_t *out)
{
    int32_t *buf = mt_malloc((size_t)n * SL * sizeof(int32_t));
    data_get_sequences(src, 0, n, buf);
    for (int i = 0; i < n; i++) {
        for (int t = 1; t < SL; t++) cr_assert_eq(buf[i * SL + t], buf[i * SL], "window torn");
        out[i] = buf[i * SL];
    }
    free(buf);
}

/* three shards of 3, 0 (short: 2 tokens) and 4 windows */
static void make_shards(char *dir)
{
    char p[128];
    make_tmpdir(dir);
    snprintf(p, sizeof p, "%s/shard-00000.bin", dir);
    write_file(p, 0, 3, 1);
    snprintf(p, sizeof p, "%s/shard-00001.bin", dir);
    write_file(p, 1, 0, 2);
    snprintf(p, sizeof p, "%s/shard-00002.bin", dir);
    write_file(p, 2, 4, 0);
    snprintf(p, sizeof p, "%s/notes.txt", dir);   /* not a .bin: a directory ignores it */
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fputs("x", f);
    fclose(f);
}

Test(data_mix, directory_glob_and_list_read_the_files_in_order)
{
    char dir[64], spec[3][512], err[ERRCAP];
    make_shards(dir);
    snprintf(spec[0], sizeof spec[0], "%s", dir);
    snprintf(spec[1], sizeof spec[1], "%s/shard-*.bin", dir);
    snprintf(spec[2], sizeof spec[2], "%s/shard-00000.bin, %s/shard-00001.bin,%s/shard-00002.bin", dir,
             dir, dir);
    const int32_t want[] = {1, 2, 3, 201, 202, 203, 204};   /* then the next epoch */
    for (int s = 0; s < 3; s++) {
        struct data_source *src = open_path(spec[s], false, 0, err);
        cr_assert(src, "%s: %s", spec[s], err);
        int32_t h[14];
        heads(src, 14, h);
        for (int i = 0; i < 14; i++) cr_expect_eq(h[i], want[i % 7], "%s: sequence %d", spec[s], i);
        cr_expect_eq(data_epoch_sequences(src), 7);
        cr_expect(strstr(data_describe(src), "in 3 file(s)"), "%s", data_describe(src));
        data_close(src);
    }
    remove_tree(dir);
}

Test(data_mix, path_errors_are_one_line_and_name_the_item)
{
    char dir[64], spec[512], err[ERRCAP];
    make_shards(dir);
    struct { const char *fmt, *want; } cases[] = {
        {"%s/missing.bin", "missing.bin: cannot open token file"},
        {"%s/nothing-*.bin", "no file matches"},
        {"%s/shard-00000.bin,,%s/shard-00002.bin", "empty item"},
        {"%s/shard-00000.bin,%s/shard-00000.bin", "listed twice"},
        {"%s/shard-00001.bin", "fewer than one sequence"},   /* one short file alone */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(spec, sizeof spec, cases[i].fmt, dir, dir);
        struct data_source *src = open_path(spec, false, 0, err);
        cr_expect_null(src, "%s opened", spec);
        cr_expect(strstr(err, cases[i].want) && !strchr(err, '\n'), "%s: got '%s'", spec, err);
        data_close(src);
    }
    char empty[64];
    make_tmpdir(empty);
    struct data_source *src = open_path(empty, false, 0, err);
    cr_expect_null(src);
    cr_expect(strstr(err, "has no *.bin token files"), "%s", err);
    remove_tree(empty);
    remove_tree(dir);
}

Test(data_mix, permutation_is_a_bijection)
{
    for (uint64_t n = 1; n < 300; n += 7) {
        char *seen = mt_calloc(n, 1);
        for (uint64_t i = 0; i < n; i++) {
            uint64_t p = data_permute(i, n, 12345 + n);
            cr_assert_lt(p, n);
            cr_assert(!seen[p], "n %llu: %llu hit twice", (unsigned long long)n, (unsigned long long)p);
            seen[p] = 1;
        }
        free(seen);
    }
}

Test(data_mix, shuffle_permutes_each_epoch_and_depends_only_on_the_seed)
{
    char dir[64], err[ERRCAP];
    make_shards(dir);
    struct data_source *a = open_path(dir, true, 5, err), *b = open_path(dir, true, 5, err);
    struct data_source *c = open_path(dir, true, 6, err);
    cr_assert(a && b && c, "%s", err);
    enum { W = 7, EP = 6 };
    int32_t ha[W * EP], hb[W * EP], hc[W * EP];
    heads(a, W * EP, ha);
    heads(b, W * EP, hb);
    heads(c, W * EP, hc);
    cr_expect(memcmp(ha, hb, sizeof ha) == 0, "same seed, different order");
    cr_expect(memcmp(ha, hc, sizeof ha) != 0, "the seed changes nothing");
    const int32_t windows[W] = {1, 2, 3, 201, 202, 203, 204};
    bool orders_differ = false, not_identity = false;
    for (int e = 0; e < EP; e++) {
        for (int w = 0; w < W; w++) {   /* every window exactly once per epoch */
            int hits = 0;
            for (int i = 0; i < W; i++) hits += ha[e * W + i] == windows[w];
            cr_expect_eq(hits, 1, "epoch %d: window %d seen %d times", e, windows[w], hits);
            not_identity |= ha[e * W + w] != windows[w];
        }
        if (e) orders_differ |= memcmp(ha + e * W, ha, W * sizeof(int32_t)) != 0;
    }
    cr_expect(not_identity && orders_differ, "shuffling left the order alone");
    /* random access: a single sequence read alone equals its place in the long read */
    int32_t one[SL];
    data_get_sequences(a, 30, 1, one);
    cr_expect_eq(one[0], ha[30]);
    data_close(a), data_close(b), data_close(c);
    remove_tree(dir);
}

static struct data_source *open_blend(const char *sources, bool shuffle, char *err)
{
    struct data_config d = { .kind = MT_DATA_TOKENS, .shuffle = shuffle, .seed = 3, .eos_id = -1,
                             .loss_after_eos = true };
    mt_strlcpy(d.sources, sources, sizeof d.sources);
    return open_cfg(&d, err);
}

Test(data_mix, blend_follows_the_weights_and_each_source_reads_in_order)
{
    char dir[64], pa[128], pb[128], spec[512], err[ERRCAP];
    make_tmpdir(dir);
    snprintf(pa, sizeof pa, "%s/a.bin", dir);
    snprintf(pb, sizeof pb, "%s/b.bin", dir);
    write_file(pa, 0, 50, 0);   /* tokens 1..50 */
    write_file(pb, 5, 30, 0);   /* tokens 501..530 */
    snprintf(spec, sizeof spec, "%s:3,%s:1", pa, pb);
    struct data_source *src = open_blend(spec, false, err);
    cr_assert(src, "%s", err);
    enum { N = 8192 };   /* two blend blocks */
    int32_t *h = mt_malloc(N * sizeof(int32_t));
    heads(src, N, h);
    int na = 0, nb = 0;
    for (int i = 0; i < N; i++) {
        if (h[i] < 500) {
            cr_assert_eq(h[i], 1 + na % 50, "source a out of order at %d", i);
            na++;
        } else {
            cr_assert_eq(h[i], 501 + nb % 30, "source b out of order at %d", i);
            nb++;
        }
    }
    cr_expect_eq(na, 2 * 3072);
    cr_expect_eq(nb, 2 * 1024);
    /* the mix holds in every batch, not just on average: 4 consecutive sequences hold 3 of a */
    for (int i = 0; i < N; i += 4) {
        int k = 0;
        for (int j = 0; j < 4; j++) k += h[i + j] < 500;
        cr_assert_eq(k, 3, "sequences %d..%d hold %d of source a", i, i + 3, k);
    }
    /* mesh invariance: any (dp, n_micro, micro_batch) split of a global batch of 24 reads the same
     * sequences as one rank reading them in order */
    const int splits[][3] = {{1, 1, 24}, {2, 3, 4}, {4, 6, 1}, {3, 2, 4}, {8, 3, 1}};
    int32_t ref[3 * 24 * SL], got[3 * 24 * SL], part[24 * SL];
    data_get_sequences(src, 0, 3 * 24, ref);
    for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++) {
        const int dp = splits[s][0], nm = splits[s][1], mb = splits[s][2];
        memset(got, 0xff, sizeof got);
        for (int step = 0; step < 3; step++)
            for (int r = 0; r < dp; r++)
                for (int m = 0; m < nm; m++) {
                    int64_t first = data_first_seq(step, m, nm, r, dp, mb);
                    data_get_sequences(src, first, mb, part);
                    memcpy(got + first * SL, part, (size_t)mb * SL * sizeof(int32_t));
                }
        cr_expect(memcmp(got, ref, sizeof ref) == 0, "dp %d x %d micro x %d differs", dp, nm, mb);
    }
    data_close(src);
    /* shuffled blend: a fresh open (a resumed run) reads the same batches */
    struct data_source *s1 = open_blend(spec, true, err), *s2 = open_blend(spec, true, err);
    cr_assert(s1 && s2, "%s", err);
    int32_t x1[64 * SL], x2[64 * SL];
    data_get_sequences(s1, 1000, 64, x1);
    data_get_sequences(s2, 1000, 64, x2);
    cr_expect(memcmp(x1, x2, sizeof x1) == 0);
    cr_expect(strstr(data_describe(s1), "blend of 2") && strstr(data_describe(s1), "shuffled"),
              "%s", data_describe(s1));
    data_close(s1), data_close(s2);
    free(h);
    remove_tree(dir);
}

Test(data_mix, blend_errors)
{
    char dir[64], pa[128], spec[600], err[ERRCAP];
    make_tmpdir(dir);
    snprintf(pa, sizeof pa, "%s/a.bin", dir);
    write_file(pa, 0, 5, 0);
    struct { const char *fmt, *want; } cases[] = {
        {"%s", "not PATH:WEIGHT"},
        {"%s:0", "positive weight"},
        {"%s:-1", "positive weight"},
        {"%s:abc", "positive weight"},
        {"%s:1,%s:0.0001", "it would get no sequences"},
        {"%s:1,/nonexistent/x.bin:1", "/nonexistent/x.bin: cannot open token file"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(spec, sizeof spec, cases[i].fmt, pa, pa);
        struct data_source *src = open_blend(spec, false, err);
        cr_expect_null(src, "%s opened", spec);
        cr_expect(strstr(err, cases[i].want) && !strchr(err, '\n'), "%s: got '%s'", spec, err);
        data_close(src);
    }
    remove_tree(dir);
}

Test(data_mix, documents_and_labels_after_eos)
{
    enum { E = 9 };
    const int32_t ids[2 * 6] = {4, E, 5, 6, E, E, /* row 2 */ E, 7, 8, E, 2, 3};
    int32_t pos[12], seg[12], labels[12];
    data_documents(E, ids, 2, 6, pos, seg);
    const int32_t want_pos[12] = {0, 1, 0, 1, 2, 0, 0, 0, 1, 2, 0, 1};
    const int32_t want_seg[12] = {0, 0, 1, 1, 1, 2, 0, 1, 1, 1, 2, 2};
    cr_expect(memcmp(pos, want_pos, sizeof pos) == 0);
    cr_expect(memcmp(seg, want_seg, sizeof seg) == 0);
    cr_expect_eq(data_labels(E, true, ids, 2, 6, labels), 10);
    cr_expect(memcmp(labels, ids, sizeof ids) == 0);
    /* no loss on the token after an EOS: positions 2 and 5 of row 1, 1 and 4 of row 2 */
    cr_expect_eq(data_labels(E, false, ids, 2, 6, labels), 6);
    for (int t = 0; t < 12; t++) {
        bool after = t % 6 > 0 && ids[t - 1] == E;
        cr_expect_eq(labels[t], after ? MT_IGNORE_INDEX : ids[t], "label %d", t);
    }
}
