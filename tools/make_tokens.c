/* make_tokens: writes a moetrain token file (docs/data.md) from a text file's bytes or from the
 * synthetic Markov chain that data.kind: synthetic uses.
 *
 *   make_tokens OUT.bin --vocab V [--dtype u16|u32]
 *               (--from-text FILE | --synthetic N [--branching B] [--seed S])
 *
 * --from-text: every byte is one token (ids 0..255), so V must be at least 256.
 * --synthetic: N tokens of the chain with B successors per state (default 4) and seed S (default 1),
 *   written as consecutive independent walks of SYNTH_CHUNK tokens, each started in the stationary
 *   distribution (the same walks data.kind: synthetic gives for seq_len SYNTH_CHUNK).
 * --dtype defaults to u16 when V <= 65536, else u32. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "data.h"

#define SYNTH_CHUNK 4096
#define TEXT_CHUNK 65536

static const char *usage =
    "usage: make_tokens OUT.bin --vocab V [--dtype u16|u32] "
    "(--from-text FILE | --synthetic N [--branching B] [--seed S])";

_Noreturn static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("make_tokens: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static long long parse_int(const char *opt, const char *s, long long lo, long long hi)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        die("%s %s: expected an integer in [%lld, %lld]", opt, s, lo, hi);
    return v;
}

/* Takes `in` already open, so a missing input never leaves a half-made output behind. */
static void write_text(struct token_writer *w, FILE *in, const char *in_path)
{
    char err[2 * MT_PATH_MAX];
    static unsigned char buf[TEXT_CHUNK];
    static uint32_t tok[TEXT_CHUNK];
    size_t n;
    int64_t total = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) {
        total += (int64_t)n;
        for (size_t i = 0; i < n; i++) tok[i] = buf[i];
        if (!token_writer_put(w, tok, (int64_t)n, err, sizeof err)) {
            token_writer_abort(w);
            die("%s", err);
        }
    }
    if (ferror(in)) {
        token_writer_abort(w);
        die("%s: read failed", in_path);
    }
    fclose(in);   /* read-only stream, fully read and checked above */
    if (!total) {
        token_writer_abort(w);
        die("%s: empty, no tokens to write", in_path);
    }
}

static void write_synthetic(struct token_writer *w, int vocab, long long n_tokens, int branching,
                            uint64_t seed)
{
    char err[2 * MT_PATH_MAX];
    struct data_config d = { .kind = MT_DATA_SYNTHETIC, .synthetic_branching = branching,
                             .synthetic_seed = seed };
    struct train_config t = { .seq_len = SYNTH_CHUNK, .global_batch_size = 1, .micro_batch_size = 1 };
    struct data_source *src = data_open(&d, &t, vocab, err, sizeof err);
    if (!src) {
        token_writer_abort(w);
        die("%s", err);
    }
    printf("%s\n", data_describe(src));
    int32_t ids[SYNTH_CHUNK];
    uint32_t tok[SYNTH_CHUNK];
    for (long long q = 0; q * SYNTH_CHUNK < n_tokens; q++) {
        data_get_sequences(src, q, 1, ids);
        int k = (int)MT_MIN((long long)SYNTH_CHUNK, n_tokens - q * SYNTH_CHUNK);
        for (int i = 0; i < k; i++) tok[i] = (uint32_t)ids[i];
        if (!token_writer_put(w, tok, k, err, sizeof err)) {
            token_writer_abort(w);
            die("%s", err);
        }
    }
    data_close(src);
}

int main(int argc, char **argv)
{
    const char *out = NULL, *text = NULL, *dtype = NULL;
    long long vocab = 0, n_synth = -1, branching = 4, seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            puts(usage);
            return 0;
        } else if (!strcmp(a, "--vocab") && has_val) {
            vocab = parse_int(a, argv[++i], 1, INT32_MAX);
        } else if (!strcmp(a, "--dtype") && has_val) {
            dtype = argv[++i];
        } else if (!strcmp(a, "--from-text") && has_val) {
            text = argv[++i];
        } else if (!strcmp(a, "--synthetic") && has_val) {
            n_synth = parse_int(a, argv[++i], 1, INT64_MAX / 4);
        } else if (!strcmp(a, "--branching") && has_val) {
            branching = parse_int(a, argv[++i], 1, INT32_MAX);
        } else if (!strcmp(a, "--seed") && has_val) {
            seed = parse_int(a, argv[++i], 0, INT64_MAX);
        } else if (a[0] == '-') {
            die("%s: unknown option or missing value; %s", a, usage);
        } else if (!out) {
            out = a;
        } else {
            die("%s: more than one output file; %s", a, usage);
        }
    }
    if (!out) die("no output file; %s", usage);
    if (!vocab) die("--vocab is required; %s", usage);
    if (!text == (n_synth < 0)) die("give exactly one of --from-text and --synthetic; %s", usage);
    if (text && vocab < 256) die("--from-text makes byte tokens 0..255, so --vocab must be >= 256 (got %lld)", vocab);

    int width = vocab <= 65536 ? 2 : 4;
    if (dtype) {
        if (!strcmp(dtype, "u16")) width = 2;
        else if (!strcmp(dtype, "u32")) width = 4;
        else die("--dtype %s: expected u16 or u32", dtype);
    }
    if (width == 2 && vocab > 65536)
        die("--dtype u16 holds ids up to 65535 but --vocab is %lld; use --dtype u32", vocab);

    FILE *in = NULL;
    if (text && !(in = fopen(text, "rb"))) die("%s: cannot open: %s", text, strerror(errno));
    char err[2 * MT_PATH_MAX];
    struct token_writer *w = token_writer_open(out, width, err, sizeof err);
    if (!w) die("%s", err);
    if (text) write_text(w, in, text);
    else write_synthetic(w, (int)vocab, n_synth, (int)branching, (uint64_t)seed);
    if (!token_writer_close(w, err, sizeof err)) die("%s", err);

    /* Read the result back through the training reader: the file it accepts is the file we meant. */
    struct data_config d = { .kind = MT_DATA_TOKENS };
    mt_strlcpy(d.path, out, sizeof d.path);
    struct train_config t = { .seq_len = 1 };
    struct data_source *src = data_open(&d, &t, (int)vocab, err, sizeof err);
    if (!src) die("%s", err);
    printf("wrote %s: %lld tokens (uint%d), vocab %lld", out, (long long)data_epoch_sequences(src),
           8 * width, vocab);
    if (!isnan(data_unigram_entropy(src))) printf(", unigram entropy %.4f nats/token", data_unigram_entropy(src));
    printf("\n");
    data_close(src);
    return 0;
}
