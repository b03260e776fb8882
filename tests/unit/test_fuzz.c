/* Fuzzers over the two parsers that read files a user hands moetrain: safetensors headers and YAML
 * configs. Each input is a mutation of a valid file (byte flips, truncation, inserted structure
 * characters, absurd lengths and offsets); every one must give success or a clear one-line error,
 * never a crash, a hang or an abort. MT_FUZZ_ITERS sets the count per parser (10^4 in make test,
 * more under make fuzz), MT_FUZZ_SEED the seed (printed on failure to replay a case). */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "safetensors.h"

static uint64_t rng;

static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static size_t below(size_t n) { return n ? (size_t)(next() % n) : 0; }

static long iters(void)
{
    const char *e = getenv("MT_FUZZ_ITERS");
    long n = e && *e ? atol(e) : 10000;
    return n > 0 ? n : 10000;
}

static uint64_t seed(void)
{
    const char *e = getenv("MT_FUZZ_SEED");
    return e && *e ? strtoull(e, NULL, 10) : 0x9e3779b97f4a7c15ull;
}

/* The error contract every rejected input must meet. */
static void expect_clear_error(const char *err, long i, uint64_t case_seed)
{
    cr_assert(err[0], "input %ld (seed %llu): rejected without a message", i, (unsigned long long)case_seed);
    cr_assert_null(strchr(err, '\n'), "input %ld (seed %llu): error is not one line: %s", i,
                   (unsigned long long)case_seed, err);
}

/* One mutation of buf (len bytes, capacity cap) in place; returns the new length. */
static size_t mutate(char *buf, size_t len, size_t cap, const char *specials)
{
    switch (below(6)) {
    case 0: /* flip bits */
        for (int k = 1 + (int)below(4); k > 0 && len; k--) buf[below(len)] ^= (char)(1u << below(8));
        return len;
    case 1: /* truncate */
        return below(len + 1);
    case 2: { /* insert a structure character */
        if (len + 1 >= cap) return len;
        size_t at = below(len + 1);
        memmove(buf + at + 1, buf + at, len - at);
        buf[at] = specials[below(strlen(specials))];
        return len + 1;
    }
    case 3: { /* delete a run */
        size_t at = below(len + 1), want = below(16), n = MT_MIN(want, len - at);
        memmove(buf + at, buf + at + n, len - at - n);
        return len - n;
    }
    case 4: { /* replace a digit run by a huge or negative number */
        static const char *const nums[] = {"18446744073709551615", "9223372036854775807", "-1", "0",
                                           "4294967296", "2147483648", "1e308", "99999999999999999999"};
        size_t at = below(len);
        while (at < len && (buf[at] < '0' || buf[at] > '9')) at++;
        if (at >= len) return len;
        size_t end = at;
        while (end < len && buf[end] >= '0' && buf[end] <= '9') end++;
        const char *n = nums[below(sizeof nums / sizeof nums[0])];
        size_t nl = strlen(n);
        if (len - (end - at) + nl >= cap) return len;
        memmove(buf + at + nl, buf + end, len - end);
        memcpy(buf + at, n, nl);
        return len - (end - at) + nl;
    }
    default: /* random byte */
        if (len) buf[below(len)] = (char)next();
        return len;
    }
}

/* A valid little safetensors file: three tensors of different dtypes, the header length field. */
static size_t base_safetensors(char *buf, size_t cap)
{
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                      "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]},"
                      "\"c\":{\"dtype\":\"F16\",\"shape\":[1,2],\"data_offsets\":[32,36]}}";
    size_t h = strlen(hdr), n = 8 + h + 36;
    cr_assert(n <= cap);
    for (int i = 0; i < 8; i++) buf[i] = (char)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, hdr, h);
    for (size_t i = 0; i < 36; i++) buf[8 + h + i] = (char)(i * 7);
    return n;
}

Test(fuzz, safetensors_reader, .timeout = 600)
{
    /* tmpfs when there is one: 10^4 small files on a disk-backed /tmp take seconds each thousand */
    char dir[64], path[96];
    snprintf(dir, sizeof dir, "%s/mt_fuzz_XXXXXX", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/f.safetensors", dir);
    static char base[4096], buf[4096];
    const size_t base_len = base_safetensors(base, sizeof base);
    char err[2048];
    long n = iters(), opened = 0;
    for (long i = 0; i < n; i++) {
        uint64_t case_seed = seed() + (uint64_t)i;
        rng = case_seed | 1;
        memcpy(buf, base, base_len);
        size_t len = base_len;
        for (int k = 1 + (int)below(3); k > 0; k--) len = mutate(buf, len, sizeof buf, "{}[]\":,-0123456789eE.");
        FILE *f = fopen(path, "wb");
        cr_assert_not_null(f);
        size_t wrote = fwrite(buf, 1, len, f);
        cr_assert_eq(wrote, len, "input %ld: wrote %zu of %zu bytes: %s", i, wrote, len, strerror(errno));
        cr_assert_eq(fclose(f), 0);
        err[0] = 0;
        struct st_file *st = st_open(path, err, sizeof err);
        if (!st) {
            expect_clear_error(err, i, case_seed);
            continue;
        }
        opened++;
        for (int t = 0; t < st->n; t++) {
            const struct st_tensor *x = &st->t[t];
            if (x->numel > 4096 || (x->dtype != ST_F32 && x->dtype != ST_BF16 && x->dtype != ST_F16)) continue;
            float out[4096];
            err[0] = 0;
            if (!st_read_f32(st, x, out, x->numel, err, sizeof err)) expect_clear_error(err, i, case_seed);
        }
        st_close(st);
    }
    cr_log_info("safetensors fuzz: %ld inputs, %ld opened", n, opened);
    cr_expect(opened > 0 && opened < n, "the mutations should both keep and break files (%ld of %ld opened)",
              opened, n);
    unlink(path);
    rmdir(dir);
}

Test(fuzz, yaml_config_loader, .timeout = 600)
{
    FILE *f = fopen("configs/tiny.yaml", "rb");
    cr_assert_not_null(f);
    static char base[16384], buf[16384];
    size_t base_len = fread(base, 1, sizeof base - 64, f);
    fclose(f);
    cr_assert(base_len > 100);
    char err[2048];
    long n = iters(), loaded = 0;
    struct config *c = malloc(sizeof *c);
    for (long i = 0; i < n; i++) {
        uint64_t case_seed = seed() + (uint64_t)i;
        rng = case_seed | 1;
        memcpy(buf, base, base_len);
        size_t len = base_len;
        for (int k = 1 + (int)below(3); k > 0; k--) len = mutate(buf, len, sizeof buf, ":-[]{}&*!|>'\"#%@`\t\n ,?");
        err[0] = 0;
        if (config_load_string_checked(c, "fuzz.yaml", buf, len, 0, NULL, err, sizeof err)) loaded++;
        else expect_clear_error(err, i, case_seed);
    }
    free(c);
    cr_log_info("yaml fuzz: %ld inputs, %ld loaded", n, loaded);
    cr_expect(loaded > 0 && loaded < n, "the mutations should both keep and break configs (%ld of %ld loaded)",
              loaded, n);
}
