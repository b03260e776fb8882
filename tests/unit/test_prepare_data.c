/* tools/prepare_data.py against the C side: the shards it writes are read back with moetrain's own
 * reader, its document index is parsed here, and the counts are compared with what this file works
 * out from the input text without Python (paragraphs = documents, one EOS at each document's end,
 * none inside). Needs the Python package `tokenizers` (make deps / make data-deps installs it). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"
#include "common.h"
#include "config.h"
#include "data.h"

#define TEXT "tests/fixtures/text/alice-ch1.txt"
#define TOK "tests/fixtures/tiny-tokenizer"
enum { EOS = 1, VOCAB = 320, SHARD = 1000 };

static char dir[64];

static void need_tokenizers(void)
{
    if (tu_run("python3 -c 'import tokenizers'", NULL) != 0)
        cr_skip_test("skipped: tokenizers not installed (make data-deps)");
}

static void setup(void)
{
    strcpy(dir, "/tmp/mt_prep_XXXXXX");
    cr_assert(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(prepare_data, .init = setup, .fini = teardown);

/* Blank-line-separated paragraphs of the text, counted in C. */
static int count_paragraphs(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert(f);
    char line[8192];
    int n = 0;
    bool in = false;
    while (fgets(line, sizeof line, f)) {
        bool blank = strspn(line, " \t\r\n") == strlen(line);
        if (!blank && !in) n++;
        in = !blank;
    }
    fclose(f);
    return n;
}

static uint64_t le64(const unsigned char *b)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | b[i];
    return v;
}

/* Reads DIR/shard-NNNNN.idx: checks its header against the shard's token count; returns starts. */
static uint64_t *read_index(int shard, uint64_t n_tokens, uint64_t *n_docs)
{
    char p[128];
    snprintf(p, sizeof p, "%s/shard-%05d.idx", dir, shard);
    FILE *f = fopen(p, "rb");
    cr_assert(f, "%s missing", p);
    unsigned char h[32];
    cr_assert_eq(fread(h, 1, 32, f), 32);
    cr_assert(memcmp(h, "MTDOCIDX", 8) == 0, "%s: bad magic", p);
    cr_assert_eq(h[8], 1, "%s: version", p);
    *n_docs = le64(h + 16);
    cr_assert_eq(le64(h + 24), n_tokens, "%s: token count differs from the shard's", p);
    uint64_t *s = mt_malloc(*n_docs * sizeof(uint64_t));
    for (uint64_t i = 0; i < *n_docs; i++) {
        unsigned char b[8];
        cr_assert_eq(fread(b, 1, 8, f), 8);
        s[i] = le64(b);
    }
    cr_assert_eq(fgetc(f), EOF, "%s: trailing bytes", p);
    fclose(f);
    return s;
}

/* Every token of one shard through the training reader (seq_len 1: sequence q is token q). */
static int32_t *read_shard(int shard, int64_t *count)
{
    char p[128], err[2048];
    snprintf(p, sizeof p, "%s/shard-%05d.bin", dir, shard);
    struct data_config d = { .kind = MT_DATA_TOKENS, .eos_id = -1, .loss_after_eos = true };
    mt_strlcpy(d.path, p, sizeof d.path);
    struct train_config t = { .seq_len = 1, .global_batch_size = 1, .micro_batch_size = 1 };
    struct data_source *src = data_open(&d, &t, VOCAB, err, sizeof err);
    cr_assert(src, "%s", err);
    *count = data_epoch_sequences(src);
    int32_t *tok = mt_malloc((size_t)*count * sizeof(int32_t));
    data_get_sequences(src, 0, (int)*count, tok);
    data_close(src);
    return tok;
}

Test(prepare_data, shards_and_document_index_match_the_text, .timeout = 120)
{
    need_tokenizers();
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer " TOK " --out %s "
             "--text-split paragraph --shard-tokens %d " TEXT, dir, SHARD);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    const int want_docs = count_paragraphs(TEXT);
    cr_assert_gt(want_docs, 5);
    int64_t total = 0, docs = 0;
    int shards = 0;
    for (;; shards++) {
        char p[128];
        snprintf(p, sizeof p, "%s/shard-%05d.bin", dir, shards);
        if (access(p, F_OK) != 0) break;
        int64_t n;
        int32_t *tok = read_shard(shards, &n);
        uint64_t nd;
        uint64_t *starts = read_index(shards, (uint64_t)n, &nd);
        cr_assert_gt(nd, 0);
        cr_expect_eq(starts[0], 0);
        int64_t eos = 0;
        for (int64_t i = 0; i < n; i++) eos += tok[i] == EOS;
        cr_expect_eq(eos, (int64_t)nd, "shard %d: %lld EOS for %llu documents", shards, (long long)eos,
                     (unsigned long long)nd);
        cr_expect_eq(tok[n - 1], EOS, "shard %d does not end with EOS", shards);
        for (uint64_t i = 1; i < nd; i++) {
            cr_expect_gt(starts[i], starts[i - 1] + 1, "empty document in shard %d", shards);
            cr_expect_eq(tok[starts[i] - 1], EOS, "shard %d: document %llu not preceded by EOS", shards,
                         (unsigned long long)i);
        }
        /* a shard closes at the first document end at or past SHARD tokens */
        cr_expect((int64_t)starts[nd - 1] < SHARD, "shard %d went on past %d tokens", shards, SHARD);
        total += n;
        docs += (int64_t)nd;
        free(tok);
        free(starts);
    }
    cr_assert_gt(shards, 1, "expected several shards of %d tokens:\n%s", SHARD, out);
    for (int s = 0; s + 1 < shards; s++) {
        char p[128];
        snprintf(p, sizeof p, "%s/shard-%05d.bin", dir, s);
        int64_t n;
        free(read_shard(s, &n));
        cr_expect_geq(n, SHARD, "shard %d closed early (%lld tokens)", s, (long long)n);
    }
    cr_expect_eq(docs, want_docs);
    char report[160];
    snprintf(report, sizeof report, "%lld documents, %lld tokens", (long long)docs, (long long)total);
    cr_expect(strstr(out, report), "report lacks '%s':\n%s", report, out);
    snprintf(report, sizeof report, "in %d shard(s)", shards);
    cr_expect(strstr(out, report), "report lacks '%s':\n%s", report, out);
    free(out);

    /* the directory trains, with document masking, on the CPU */
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=2 "
             "--set train.seq_len=32 --set train.global_batch_size=4 --set train.micro_batch_size=2 "
             "--set data.kind=tokens --set data.path=%s --set data.eos_id=%d "
             "--set data.document_masking=true --set data.loss_after_eos=false --set data.shuffle=true",
             tu_build(), dir, EOS);
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "document masking after eos 1"), "%s", out);
    free(out);

    /* a second run into the same directory is refused without --force */
    snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer " TOK " --out %s " TEXT, dir);
    cr_expect_eq(tu_run(cmd, &out), 2, "%s", out);
    cr_expect(strstr(out, "pass --force"), "%s", out);
    free(out);
}

Test(prepare_data, jsonl_key_and_errors, .timeout = 60)
{
    need_tokenizers();
    char in[128], cmd[1024], *out = NULL;
    snprintf(in, sizeof in, "%s/in.jsonl", dir);
    FILE *f = fopen(in, "w");
    cr_assert(f);
    fputs("{\"body\": \"Alice was beginning to get very tired.\"}\n\n"
          "{\"body\": \"Down, down, down.\", \"id\": 2}\n{\"body\": \"Oh dear!\"}\n", f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer " TOK " --out %s/o "
             "--text-key body --prefix part %s", dir, in);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "3 documents") && strstr(out, "in 1 shard(s)"), "%s", out);
    free(out);
    char p[160];
    snprintf(p, sizeof p, "%s/o/part-00000.idx", dir);
    cr_expect_eq(access(p, F_OK), 0);

    struct { const char *args, *want; } bad[] = {
        {"--text-key text", "in.jsonl:1: no field 'text'"},
        {"--eos-id 999 --text-key body", "EOS id 999 (--eos-id) is outside the tokenizer's vocabulary"},
        {"--shard-tokens 0 --text-key body", "--shard-tokens 0 must be positive"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer " TOK " --out %s/b%zu %s %s",
                 dir, i, bad[i].args, in);
        cr_expect_eq(tu_run(cmd, &out), 2, "%s", out);
        cr_expect(strstr(out, bad[i].want), "expected '%s' in: %s", bad[i].want, out);
        free(out);
    }
    snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer %s --out %s/c %s", dir, dir, in);
    cr_expect_eq(tu_run(cmd, &out), 2, "%s", out);
    cr_expect(strstr(out, "no tokenizer.json"), "%s", out);
    free(out);
}

/* Parquet input is optional (pyarrow is heavy): tested where it is installed. */
Test(prepare_data, parquet_column, .timeout = 60)
{
    need_tokenizers();
    if (tu_run("python3 -c 'import pyarrow'", NULL) != 0)
        cr_skip_test("skipped: pyarrow not installed (optional: pip install -r tools/requirements-parquet.txt)");
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "python3 -c \"import pyarrow as pa, pyarrow.parquet as pq; "
             "pq.write_table(pa.table({'body': ['Alice was tired.', None, 'Down, down.', 'Oh dear!'], "
             "'n': [1, 2, 3, 4]}), '%s/in.parquet')\"", dir);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer " TOK " --out %s/o --text-key body "
             "%s/in.parquet", dir, dir);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "3 documents"), "%s", out);   /* the null row is not a document */
    free(out);
    snprintf(cmd, sizeof cmd, "python3 tools/prepare_data.py --tokenizer " TOK " --out %s/p --text-key n "
             "%s/in.parquet", dir, dir);
    cr_expect_eq(tu_run(cmd, &out), 2, "%s", out);
    cr_expect(strstr(out, "column 'n' holds int values, not text"), "%s", out);
    free(out);
}
