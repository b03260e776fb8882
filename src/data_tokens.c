/* Token files ("MTTOKENS" v1, data.h): the checked reader and the streaming writer.
 *
 * The reader never maps or loads the whole file: a sequence is one pread at its offset, so files far
 * larger than memory work and many ranks can read the same file. Small files are scanned completely at
 * open, so a bad token id is reported before training starts; every read checks ids again, so a large
 * file (or one changed after open) can never index past the vocabulary. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "data.h"
#include "data_internal.h"

/* Files with at most this many tokens (64 MiB as uint32) are scanned at open: ids checked, unigram
 * entropy computed. */
#define TOKENS_SCAN_LIMIT (1LL << 24)
#define TOKENS_SCAN_CHUNK (1 << 20)

struct token_file {
    char path[MT_PATH_MAX];
    int fd;
    int width;              /* bytes per token: 2 or 4 */
    int vocab;
    int seq_len;
    int64_t count;          /* tokens in the file */
    int64_t usable;         /* count rounded down to a multiple of seq_len */
    double unigram_entropy; /* NAN when the file was too large to scan */
};

static uint32_t get_le32(const unsigned char *b)
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static uint64_t get_le64(const unsigned char *b)
{
    return (uint64_t)get_le32(b) | (uint64_t)get_le32(b + 4) << 32;
}

static void put_le32(unsigned char *b, uint32_t v)
{
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}

static void put_le64(unsigned char *b, uint64_t v)
{
    put_le32(b, (uint32_t)v);
    put_le32(b + 4, (uint32_t)(v >> 32));
}

/* Reads exactly n bytes at offset off; a short read means the file shrank after open. */
static bool read_at(const struct token_file *f, void *buf, size_t n, int64_t off, char *err, int errcap)
{
    char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t k = pread(f->fd, p + done, n - done, (off_t)(off + (int64_t)done));
        if (k < 0) {
            if (errno == EINTR) continue;
            snprintf(err, errcap, "%s: read of %zu bytes at offset %lld failed: %s", f->path, n - done,
                     (long long)(off + (int64_t)done), strerror(errno));
            return false;
        }
        if (k == 0) {
            snprintf(err, errcap, "%s: unexpected end of file at offset %lld (was it changed after it "
                     "was opened?)", f->path, (long long)(off + (int64_t)done));
            return false;
        }
        done += (size_t)k;
    }
    return true;
}

/* Decodes n little-endian tokens that read_at placed at the start of out, in place: out[i] occupies
 * bytes [4i, 4i+4), at or after the bytes of token i, so walking backwards never overwrites a token
 * not yet decoded. Checks ids against the vocabulary; first_token is the index of out[0] in the file. */
static bool decode_tokens(const struct token_file *f, int32_t *out, int64_t n, int64_t first_token,
                          char *err, int errcap)
{
    const unsigned char *b = (const unsigned char *)out;
    for (int64_t i = n - 1; i >= 0; i--) {
        uint32_t v = f->width == 2 ? (uint32_t)b[2 * i] | (uint32_t)b[2 * i + 1] << 8 : get_le32(b + 4 * i);
        if (v >= (uint32_t)f->vocab) {
            snprintf(err, errcap, "%s: token %lld has id %u >= vocab_size %d", f->path,
                     (long long)(first_token + i), v, f->vocab);
            return false;
        }
        out[i] = (int32_t)v;
    }
    return true;
}

/* Reads every token once: validates ids and computes the unigram entropy (nats). */
static bool scan(struct token_file *f, char *err, int errcap)
{
    int64_t *counts = mt_calloc((size_t)f->vocab, sizeof(int64_t));
    int32_t *buf = mt_malloc(sizeof(int32_t) * TOKENS_SCAN_CHUNK);
    bool ok = true;
    for (int64_t at = 0; ok && at < f->count; at += TOKENS_SCAN_CHUNK) {
        int64_t n = MT_MIN((int64_t)TOKENS_SCAN_CHUNK, f->count - at);
        ok = read_at(f, buf, (size_t)(n * f->width), MT_TOKENS_HEADER_BYTES + at * f->width, err, errcap) &&
             decode_tokens(f, buf, n, at, err, errcap);
        for (int64_t i = 0; ok && i < n; i++) counts[buf[i]]++;
    }
    if (ok) {
        double h = 0;
        for (int v = 0; v < f->vocab; v++) {
            if (!counts[v]) continue;
            double p = (double)counts[v] / (double)f->count;
            h -= p * log(p);
        }
        f->unigram_entropy = h;
    }
    free(buf);
    free(counts);
    return ok;
}

static struct token_file *fail(struct token_file *f)
{
    if (f->fd >= 0) close(f->fd);
    free(f);
    return NULL;
}

struct token_file *token_file_open(const char *path, int vocab, int seq_len, bool allow_short,
                                   char *err, int errcap)
{
    struct token_file *f = mt_calloc(1, sizeof *f);
    f->fd = -1;
    f->vocab = vocab;
    f->seq_len = seq_len;
    f->unigram_entropy = NAN;
    if (!mt_strlcpy(f->path, path, sizeof f->path)) {
        snprintf(err, errcap, "%.200s...: token file path longer than %d characters", path, MT_PATH_MAX - 1);
        return fail(f);
    }
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        snprintf(err, errcap, "%s: cannot open token file: %s", path, strerror(errno));
        return fail(f);
    }
    struct stat st;
    if (fstat(f->fd, &st) != 0) {
        snprintf(err, errcap, "%s: cannot stat token file: %s", path, strerror(errno));
        return fail(f);
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errcap, "%s: not a regular file", path);
        return fail(f);
    }
    int64_t size = (int64_t)st.st_size;
    if (size < MT_TOKENS_HEADER_BYTES) {
        snprintf(err, errcap, "%s: not a moetrain token file (%lld bytes, shorter than the %d-byte header)",
                 path, (long long)size, MT_TOKENS_HEADER_BYTES);
        return fail(f);
    }
    unsigned char h[MT_TOKENS_HEADER_BYTES];
    if (!read_at(f, h, sizeof h, 0, err, errcap)) return fail(f);
    if (memcmp(h, MT_TOKENS_MAGIC, 8) != 0) {
        snprintf(err, errcap, "%s: not a moetrain token file (bad magic, expected \"%s\")", path,
                 MT_TOKENS_MAGIC);
        return fail(f);
    }
    uint32_t version = get_le32(h + 8), dtype = get_le32(h + 12);
    uint64_t count = get_le64(h + 16);
    if (version != MT_TOKENS_VERSION) {
        snprintf(err, errcap, "%s: unsupported token file version %u (this build reads version %u)",
                 path, version, MT_TOKENS_VERSION);
        return fail(f);
    }
    if (dtype != 2 && dtype != 4) {
        snprintf(err, errcap, "%s: unsupported token dtype %u (expected 2 = uint16 or 4 = uint32)",
                 path, dtype);
        return fail(f);
    }
    f->width = (int)dtype;
    uint64_t max_count = (uint64_t)(INT64_MAX - MT_TOKENS_HEADER_BYTES) / dtype;
    if (count > max_count ||
        (int64_t)count * f->width + MT_TOKENS_HEADER_BYTES != size) {
        snprintf(err, errcap, "%s: file is %lld bytes but its header says %d + %llu tokens x %u bytes "
                 "(truncated or trailing bytes)", path, (long long)size, MT_TOKENS_HEADER_BYTES,
                 (unsigned long long)count, dtype);
        return fail(f);
    }
    f->count = (int64_t)count;
    if (f->count < seq_len && !allow_short) {
        snprintf(err, errcap, "%s: %lld tokens, fewer than one sequence of train.seq_len %d", path,
                 (long long)f->count, seq_len);
        return fail(f);
    }
    f->usable = f->count / seq_len * seq_len;
    if (f->count <= TOKENS_SCAN_LIMIT && !scan(f, err, errcap)) return fail(f);
    return f;
}

void token_file_close(struct token_file *f)
{
    if (!f) return;
    close(f->fd);   /* read-only descriptor: nothing to lose if close reports an error */
    free(f);
}

bool token_file_sequence(const struct token_file *f, int64_t q, int32_t *out, char *err, int errcap)
{
    int seq_len = f->seq_len;
    /* usable is a multiple of seq_len, so a window never straddles the wrap-around. */
    int64_t first = (int64_t)((uint64_t)q % (uint64_t)(f->usable / seq_len)) * seq_len;
    return read_at(f, out, (size_t)seq_len * f->width, MT_TOKENS_HEADER_BYTES + first * f->width,
                   err, errcap) &&
           decode_tokens(f, out, seq_len, first, err, errcap);
}

int64_t token_file_count(const struct token_file *f) { return f->count; }
int token_file_width(const struct token_file *f) { return f->width; }
int64_t token_file_epoch_sequences(const struct token_file *f) { return f->usable / f->seq_len; }
double token_file_unigram_entropy(const struct token_file *f) { return f->unigram_entropy; }

/* ---- writer ---- */

struct token_writer {
    char path[MT_PATH_MAX];
    char tmp[MT_PATH_MAX + 8];
    FILE *fp;
    int width;
    int64_t count;
};

struct token_writer *token_writer_open(const char *path, int width, char *err, int errcap)
{
    if (width != 2 && width != 4) {
        snprintf(err, errcap, "%s: token width %d must be 2 (uint16) or 4 (uint32)", path, width);
        return NULL;
    }
    struct token_writer *w = mt_calloc(1, sizeof *w);
    w->width = width;
    if (!mt_strlcpy(w->path, path, sizeof w->path)) {
        snprintf(err, errcap, "%.200s...: token file path longer than %d characters", path, MT_PATH_MAX - 1);
        free(w);
        return NULL;
    }
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp", path);
    w->fp = fopen(w->tmp, "wb");
    if (!w->fp) {
        snprintf(err, errcap, "%s: cannot create: %s", w->tmp, strerror(errno));
        free(w);
        return NULL;
    }
    /* The count is patched on close; until then the header says 0 tokens and the size disagrees, so
     * a reader rejects a half-written file even if it somehow sees it. */
    unsigned char h[MT_TOKENS_HEADER_BYTES];
    memcpy(h, MT_TOKENS_MAGIC, 8);
    put_le32(h + 8, MT_TOKENS_VERSION);
    put_le32(h + 12, (uint32_t)width);
    put_le64(h + 16, 0);
    if (fwrite(h, 1, sizeof h, w->fp) != sizeof h) {
        snprintf(err, errcap, "%s: write failed: %s", w->tmp, strerror(errno));
        token_writer_abort(w);
        return NULL;
    }
    return w;
}

bool token_writer_put(struct token_writer *w, const uint32_t *tokens, int64_t n, char *err, int errcap)
{
    unsigned char buf[4096];
    int per = (int)sizeof buf / w->width;
    for (int64_t at = 0; at < n; at += per) {
        int k = (int)MT_MIN((int64_t)per, n - at);
        for (int i = 0; i < k; i++) {
            uint32_t v = tokens[at + i];
            if (w->width == 2) {
                if (v > 0xffff) {
                    snprintf(err, errcap, "%s: token %lld has id %u, too large for uint16 (use uint32)",
                             w->path, (long long)(w->count + at + i), v);
                    return false;
                }
                buf[2 * i] = (unsigned char)v;
                buf[2 * i + 1] = (unsigned char)(v >> 8);
            } else {
                put_le32(buf + 4 * i, v);
            }
        }
        if (fwrite(buf, (size_t)w->width, (size_t)k, w->fp) != (size_t)k) {
            snprintf(err, errcap, "%s: write failed: %s", w->tmp, strerror(errno));
            return false;
        }
    }
    w->count += n;
    return true;
}

bool token_writer_close(struct token_writer *w, char *err, int errcap)
{
    unsigned char c[8];
    put_le64(c, (uint64_t)w->count);
    if (fseek(w->fp, 16, SEEK_SET) != 0 || fwrite(c, 1, 8, w->fp) != 8 || fflush(w->fp) != 0 ||
        fsync(fileno(w->fp)) != 0) {
        snprintf(err, errcap, "%s: write failed: %s", w->tmp, strerror(errno));
        token_writer_abort(w);
        return false;
    }
    int rc = fclose(w->fp);
    w->fp = NULL;
    if (rc != 0) {
        snprintf(err, errcap, "%s: close failed: %s", w->tmp, strerror(errno));
        token_writer_abort(w);
        return false;
    }
    if (rename(w->tmp, w->path) != 0) {
        snprintf(err, errcap, "%s: cannot rename %s to it: %s", w->path, w->tmp, strerror(errno));
        token_writer_abort(w);
        return false;
    }
    free(w);
    return true;
}

void token_writer_abort(struct token_writer *w)
{
    if (!w) return;
    if (w->fp) fclose(w->fp);   /* the file is being discarded: a close error changes nothing */
    remove(w->tmp);             /* may already be gone (renamed or never created): nothing to report */
    free(w);
}
