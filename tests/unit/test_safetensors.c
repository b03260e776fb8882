/* safetensors reader/writer: the fixture files (written by transformers, independent of this code),
 * exact half-precision conversions on hand-computed bit patterns, and one-line errors on corrupt files. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "safetensors.h"

#define FIXTURE "tests/fixtures/qwen3moe-tiny"
#define MODEL_ST FIXTURE "/model.safetensors"
#define REF_ST FIXTURE "/reference.safetensors"

static char tmpdir[256];
static char err[2048];

static void mk_tmp(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/mt_st_XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp failed");
}

static void rm_tmp(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (tmpdir[0] && system(cmd) != 0) cr_log_warn("could not remove %s", tmpdir);
}

TestSuite(safetensors, .init = mk_tmp, .fini = rm_tmp);

static void tmp_path(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", tmpdir, name);
}

/* Writes an 8-byte length (declared_len, or strlen(header) when < 0), the header and n_data zero bytes. */
static void write_raw_file(const char *path, long long declared_len, const char *header, size_t n_data)
{
    FILE *fp = fopen(path, "wb");
    cr_assert_not_null(fp, "fopen %s", path);
    unsigned long long len = declared_len < 0 ? strlen(header) : (unsigned long long)declared_len;
    unsigned char lb[8];
    for (int i = 0; i < 8; i++) lb[i] = (unsigned char)(len >> (8 * i));
    cr_assert_eq(fwrite(lb, 1, 8, fp), 8);
    cr_assert_eq(fwrite(header, 1, strlen(header), fp), strlen(header));
    for (size_t i = 0; i < n_data; i++) cr_assert_eq(fputc(0, fp), 0);
    cr_assert_eq(fclose(fp), 0);
}

/* st_open must fail with one line that names the file and contains `what`. */
static void expect_open_error(const char *path, const char *what)
{
    struct st_file *f = st_open(path, err, sizeof err);
    cr_assert_null(f, "st_open(%s) succeeded, expected an error about '%s'", path, what);
    cr_assert_not_null(strstr(err, path), "error does not name the file: %s", err);
    cr_assert_not_null(strstr(err, what), "error does not say '%s': %s", what, err);
    cr_assert_null(strchr(err, '\n'), "error is not one line: %s", err);
}

Test(safetensors, fixture_headers)
{
    struct st_file *m = st_open(MODEL_ST, err, sizeof err);
    cr_assert_not_null(m, "%s", err);
    /* embed, lm_head, final norm + per layer: 2 norms, q/k/v/o, q/k norm, router, 8 experts x 3 */
    cr_assert_eq(m->n, 3 + 2 * (2 + 4 + 2 + 1 + 8 * 3), "tensor count %d", m->n);
    const struct st_tensor *t = st_find(m, "model.layers.1.mlp.experts.3.up_proj.weight");
    cr_assert_not_null(t);
    cr_assert_eq(t->dtype, ST_F32);
    cr_assert_eq(t->ndim, 2);
    cr_assert_eq(t->shape[0], 32);
    cr_assert_eq(t->shape[1], 64);
    cr_assert_eq(t->end - t->begin, 32 * 64 * 4);
    cr_assert_null(st_find(m, "__metadata__"));
    cr_assert_null(st_find(m, "model.layers.2.mlp.gate.weight"));
    for (int i = 1; i < m->n; i++) cr_assert(strcmp(m->t[i - 1].name, m->t[i].name) < 0, "index not sorted");
    st_close(m);

    struct st_file *r = st_open(REF_ST, err, sizeof err);
    cr_assert_not_null(r, "%s", err);
    t = st_find(r, "param.model.layers.0.mlp.experts.gate_up_proj");
    cr_assert_not_null(t);
    cr_assert_eq(t->ndim, 3);
    cr_assert(t->shape[0] == 8 && t->shape[1] == 64 && t->shape[2] == 64);
    const struct st_tensor *ids = st_find(r, "input_ids"), *labels = st_find(r, "labels");
    cr_assert(ids && labels);
    cr_assert_eq(ids->dtype, ST_I64);
    int64_t a[48], b[48];
    cr_assert(st_read_i64(r, ids, a, 48, err, sizeof err), "%s", err);
    cr_assert(st_read_i64(r, labels, b, 48, err, sizeof err), "%s", err);
    for (int i = 0; i < 48; i++) {
        cr_assert(a[i] >= 0 && a[i] < 512, "token %lld out of the vocabulary", (long long)a[i]);
        cr_assert_eq(a[i], b[i], "labels equal input_ids (README)");
    }
    /* asking for the wrong count or the wrong kind of data is an error, not a silent misread */
    cr_assert_not(st_read_i64(r, ids, a, 47, err, sizeof err));
    float fl[48];
    cr_assert_not(st_read_f32(r, ids, fl, 48, err, sizeof err));
    cr_assert_not_null(strstr(err, "input_ids"), "%s", err);
    st_close(r);
}

/* The hub file and the reference dump come from transformers independently of this code: the
 * per-expert hub tensors must be exact slices of the fused in-memory parameters. */
Test(safetensors, hub_tensors_equal_reference_params)
{
    struct st_file *m = st_open(MODEL_ST, err, sizeof err);
    cr_assert_not_null(m, "%s", err);
    struct st_file *r = st_open(REF_ST, err, sizeof err);
    cr_assert_not_null(r, "%s", err);
    const int E = 8, I = 32, H = 64;
    float hub[64 * 64], ref[64 * 64];
    char name[160];
    for (int l = 0; l < 2; l++) {
        snprintf(name, sizeof name, "param.model.layers.%d.mlp.experts.gate_up_proj", l);
        const struct st_tensor *gu = st_find(r, name);
        snprintf(name, sizeof name, "param.model.layers.%d.mlp.experts.down_proj", l);
        const struct st_tensor *dn = st_find(r, name);
        cr_assert(gu && dn);
        for (int e = 0; e < E; e++) {
            const char *parts[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int p = 0; p < 3; p++) {
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, parts[p]);
                const struct st_tensor *t = st_find(m, name);
                cr_assert_not_null(t, "%s", name);
                cr_assert(st_read_f32(m, t, hub, I * H, err, sizeof err), "%s", err);
                /* gate rows [0, I) of expert e, up rows [I, 2I); down_proj[e] */
                const struct st_tensor *src = p < 2 ? gu : dn;
                int64_t elem0 = p < 2 ? (int64_t)e * 2 * I * H + p * I * H : (int64_t)e * H * I;
                cr_assert(st_read_f32_range(r, src, elem0, I * H, ref, err, sizeof err), "%s", err);
                cr_assert_eq(memcmp(hub, ref, sizeof(float) * I * H), 0, "%s differs from the reference", name);
            }
        }
    }
    const char *plain[] = {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_norm.weight"};
    for (int i = 0; i < 3; i++) {
        const struct st_tensor *t = st_find(m, plain[i]);
        snprintf(name, sizeof name, "param.%s", plain[i]);
        const struct st_tensor *u = st_find(r, name);
        cr_assert(t && u && t->numel == u->numel);
        float *x = malloc(sizeof(float) * t->numel), *y = malloc(sizeof(float) * t->numel);
        cr_assert(st_read_f32(m, t, x, t->numel, err, sizeof err), "%s", err);
        cr_assert(st_read_f32(r, u, y, u->numel, err, sizeof err), "%s", err);
        cr_assert_eq(memcmp(x, y, sizeof(float) * t->numel), 0, "%s", plain[i]);
        free(x);
        free(y);
    }
    cr_assert_not(st_read_f32_range(r, st_find(r, "loss"), 0, 2, ref, err, sizeof err), "range past the end");
    st_close(m);
    st_close(r);
}

Test(safetensors, half_precision_bit_patterns)
{
    /* bf16 is the top half of an f32: 0x3F80 -> 0x3F800000 = 1.0, 0xC000 -> 0xC0000000 = -2.0 */
    cr_assert_eq(st_bf16_to_f32(0x3F80), 1.0f);
    cr_assert_eq(st_bf16_to_f32(0xC000), -2.0f);
    cr_assert_eq(st_bf16_to_f32(0x4049), 3.140625f);      /* 1.1001001b * 2 = 3 + 9/64 */
    cr_assert_eq(st_bf16_to_f32(0x0001), ldexpf(1.0f, -133)); /* smallest subnormal: 2^-126 * 2^-7 */
    cr_assert(isinf(st_bf16_to_f32(0x7F80)) && st_bf16_to_f32(0x7F80) > 0);
    cr_assert(isnan(st_bf16_to_f32(0x7FC0)));

    /* f16: 1 sign, 5 exponent (bias 15), 10 mantissa bits */
    cr_assert_eq(st_f16_to_f32(0x3C00), 1.0f);
    cr_assert_eq(st_f16_to_f32(0xC000), -2.0f);
    cr_assert_eq(st_f16_to_f32(0x3555), 0x1.554p-2f);      /* exp 13 -> 2^-2, mantissa 0x155/1024 */
    cr_assert_eq(st_f16_to_f32(0x0001), ldexpf(1.0f, -24)); /* smallest subnormal */
    cr_assert_eq(st_f16_to_f32(0x03FF), 1023.0f * ldexpf(1.0f, -24)); /* largest subnormal */
    cr_assert_eq(st_f16_to_f32(0x0400), ldexpf(1.0f, -14)); /* smallest normal */
    cr_assert_eq(st_f16_to_f32(0x7BFF), 65504.0f);          /* largest finite: (2 - 2^-10) * 2^15 */
    cr_assert_eq(st_f16_to_f32(0x8001), -ldexpf(1.0f, -24));
    float negz = st_f16_to_f32(0x8000);
    cr_assert(negz == 0.0f && signbit(negz));
    cr_assert(isinf(st_f16_to_f32(0x7C00)) && st_f16_to_f32(0x7C00) > 0);
    cr_assert(isinf(st_f16_to_f32(0xFC00)) && st_f16_to_f32(0xFC00) < 0);
    cr_assert(isnan(st_f16_to_f32(0x7E00)));
    cr_assert(isnan(st_f16_to_f32(0x7C01)));

    /* f32 -> bf16 rounds to nearest even: 1 + 2^-8 is halfway between 0x3F80 and 0x3F81 -> even 0x3F80;
     * 1 + 3*2^-8 is halfway between 0x3F81 and 0x3F82 -> 0x3F82; just above a tie rounds up. */
    cr_assert_eq(st_f32_to_bf16(1.0f), 0x3F80);
    cr_assert_eq(st_f32_to_bf16(-2.0f), 0xC000);
    cr_assert_eq(st_f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);
    cr_assert_eq(st_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);
    cr_assert_eq(st_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
    cr_assert_eq(st_f32_to_bf16(INFINITY), 0x7F80);
    cr_assert_eq(st_f32_to_bf16(0x1.fffffep127f), 0x7F80, "the largest float rounds up to inf");
    cr_assert(isnan(st_bf16_to_f32(st_f32_to_bf16(NAN))));
}

/* Half-precision and integer tensors through a file: the writer, the header and the converting reads. */
Test(safetensors, write_and_read_back)
{
    char path[512];
    tmp_path(path, sizeof path, "mixed.safetensors");
    const uint16_t bf[4] = {0x3F80, 0xC000, 0x7F80, 0x0001};
    const uint16_t hf[5] = {0x3C00, 0x0001, 0x7C00, 0x03FF, 0xC000};
    const float f32[6] = {1.5f, -0.1f, 3e-39f, 1e30f, 0.0f, 7.0f};
    const int64_t i64[3] = {-5, 0, (int64_t)1 << 40};
    const int32_t i32[2] = {-7, 123456};
    const float want_bf[4] = {1.0f, -2.0f, INFINITY, 0x1p-133f};
    const float want_hf[5] = {1.0f, 0x1p-24f, INFINITY, 1023 * 0x1p-24f, -2.0f};
    int64_t s4[1] = {4}, s5[2] = {5, 1}, s6[2] = {2, 3}, s3[1] = {3}, s2[1] = {2}, s0[1] = {0};

    struct st_writer *w = st_writer_new();
    st_writer_add_raw(w, "bf", ST_BF16, 1, s4, bf);
    st_writer_add_raw(w, "hf", ST_F16, 2, s5, hf);
    st_writer_add_f32(w, "f32", ST_F32, 2, s6, f32);
    st_writer_add_f32(w, "f32_as_bf16", ST_BF16, 2, s6, f32);
    st_writer_add_raw(w, "i64", ST_I64, 1, s3, i64);
    st_writer_add_raw(w, "i32", ST_I32, 1, s2, i32);
    st_writer_add_f32(w, "empty", ST_F32, 1, s0, NULL);
    st_writer_add_f32(w, "scalar", ST_F32, 0, NULL, f32);
    cr_assert(st_writer_finish(w, path, err, sizeof err), "%s", err);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    cr_assert_neq(access(tmp, F_OK), 0, "temporary file left behind");

    struct st_file *f = st_open(path, err, sizeof err);
    cr_assert_not_null(f, "%s", err);
    cr_assert_eq(f->n, 8);
    cr_assert_eq(f->data_start % 8, 0, "header padded to 8 bytes");
    float out[6];
    const struct st_tensor *t = st_find(f, "bf");
    cr_assert(t && t->dtype == ST_BF16 && t->numel == 4);
    cr_assert(st_read_f32(f, t, out, 4, err, sizeof err), "%s", err);
    for (int i = 0; i < 4; i++) cr_assert_eq(out[i], want_bf[i], "bf[%d] = %a", i, out[i]);
    t = st_find(f, "hf");
    cr_assert(t && t->dtype == ST_F16 && t->ndim == 2 && t->shape[0] == 5 && t->shape[1] == 1);
    cr_assert(st_read_f32(f, t, out, 5, err, sizeof err), "%s", err);
    for (int i = 0; i < 5; i++) cr_assert_eq(out[i], want_hf[i], "hf[%d] = %a", i, out[i]);
    cr_assert(st_read_f32_range(f, t, 3, 2, out, err, sizeof err), "%s", err);
    cr_assert(out[0] == want_hf[3] && out[1] == want_hf[4]);
    t = st_find(f, "f32");
    cr_assert(st_read_f32(f, t, out, 6, err, sizeof err), "%s", err);
    cr_assert_eq(memcmp(out, f32, sizeof f32), 0);
    t = st_find(f, "f32_as_bf16");
    cr_assert(t && t->dtype == ST_BF16);
    cr_assert(st_read_f32(f, t, out, 6, err, sizeof err), "%s", err);
    for (int i = 0; i < 6; i++) cr_assert_eq(out[i], st_bf16_to_f32(st_f32_to_bf16(f32[i])));
    int64_t iv[3];
    cr_assert(st_read_i64(f, st_find(f, "i64"), iv, 3, err, sizeof err), "%s", err);
    cr_assert(iv[0] == -5 && iv[1] == 0 && iv[2] == (int64_t)1 << 40);
    cr_assert(st_read_i64(f, st_find(f, "i32"), iv, 2, err, sizeof err), "%s", err);
    cr_assert(iv[0] == -7 && iv[1] == 123456);
    t = st_find(f, "empty");
    cr_assert(t && t->numel == 0 && st_read_f32(f, t, out, 0, err, sizeof err));
    t = st_find(f, "scalar");
    cr_assert(t && t->ndim == 0 && t->numel == 1);
    cr_assert(st_read_f32(f, t, out, 1, err, sizeof err) && out[0] == 1.5f);
    st_close(f);

    w = st_writer_new();
    st_writer_add_f32(w, "a", ST_F32, 1, s2, f32);
    st_writer_add_f32(w, "a", ST_F32, 1, s2, f32);
    cr_assert_not(st_writer_finish(w, path, err, sizeof err), "duplicate names accepted");
    cr_assert_not_null(strstr(err, "'a'"), "%s", err);
}

Test(safetensors, corrupt_files)
{
    char p[512];
    struct { const char *file; long long len; const char *header; size_t data; const char *what; } cases[] = {
        {"short.safetensors", -2, "", 0, "too short"},
        {"hugelen.safetensors", 1000, "{}", 0, "larger than the file"},
        {"badjson.safetensors", -1, "{\"a\": {\"dtype\": \"F32\",", 0, "not valid JSON"},
        {"notobj.safetensors", -1, "[1, 2]", 0, "not a JSON object"},
        {"dup.safetensors", -1,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "not valid JSON"},
        {"nodtype.safetensors", -1, "{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "'w' has no \"dtype\""},
        {"noshape.safetensors", -1, "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "'w' has no \"shape\""},
        {"nooffs.safetensors", -1, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "'w' has no \"data_offsets\""},
        {"baddtype.safetensors", -1, "{\"w\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
         "unknown dtype \"F33\""},
        {"range.safetensors", -1, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 24,
         "'w' has shape [2, 3] of F32 (24 bytes) but data_offsets [0, 20] span 20 bytes"},
        {"negdim.safetensors", -1, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
         "not a non-negative integer"},
        {"backwards.safetensors", -1, "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8,
         "end before they begin"},
        {"offsets.safetensors", -1, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":\"0-8\"}}", 8,
         "not a pair"},
        {"entry.safetensors", -1, "{\"w\":[1]}", 8, "'w': entry is not a JSON object"},
        {"trunc.safetensors", -1, "{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,4],\"data_offsets\":[0,32]}}", 31,
         "truncated"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tmp_path(p, sizeof p, cases[i].file);
        if (cases[i].len == -2) {
            FILE *fp = fopen(p, "wb");
            cr_assert(fp && fwrite("abcde", 1, 5, fp) == 5 && fclose(fp) == 0);
        } else {
            write_raw_file(p, cases[i].len, cases[i].header, cases[i].data);
        }
        expect_open_error(p, cases[i].what);
    }
    tmp_path(p, sizeof p, "absent.safetensors");
    expect_open_error(p, "cannot open");
    expect_open_error(tmpdir, "not a regular file");

    /* ranges listed out of file order are accepted (overlapping ones are not: see below) */
    tmp_path(p, sizeof p, "unordered.safetensors");
    write_raw_file(p, -1, "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
                          "\"a\":{\"dtype\":\"I32\",\"shape\":[3],\"data_offsets\":[0,12]}}", 20);
    struct st_file *f = st_open(p, err, sizeof err);
    cr_assert_not_null(f, "%s", err);
    st_close(f);
}

/* A file that shrinks after it was opened fails on read, naming the file. */
Test(safetensors, truncated_after_open)
{
    char p[512];
    tmp_path(p, sizeof p, "shrinks.safetensors");
    float v[256];
    for (int i = 0; i < 256; i++) v[i] = (float)i;
    int64_t shape[1] = {256};
    struct st_writer *w = st_writer_new();
    st_writer_add_f32(w, "v", ST_F32, 1, shape, v);
    cr_assert(st_writer_finish(w, p, err, sizeof err), "%s", err);
    struct st_file *f = st_open(p, err, sizeof err);
    cr_assert_not_null(f, "%s", err);
    cr_assert_eq(truncate(p, (off_t)(f->file_size - 100)), 0);
    float out[256];
    cr_assert_not(st_read_f32(f, st_find(f, "v"), out, 256, err, sizeof err));
    cr_assert_not_null(strstr(err, p), "%s", err);
    cr_assert_not_null(strstr(err, "end of file"), "%s", err);
    st_close(f);
}

/* Two tensors naming the same bytes would alias: refused, whatever the order in the header. */
Test(safetensors, overlapping_offsets_are_refused)
{
    char p[512];
    tmp_path(p, sizeof p, "overlap.safetensors");
    write_raw_file(p, -1,
                   "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]},"
                   "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12);
    expect_open_error(p, "overlap");
    /* adjacent ranges and an empty tensor at a shared offset are fine */
    tmp_path(p, sizeof p, "adjacent.safetensors");
    write_raw_file(p, -1,
                   "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
                   "\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]},"
                   "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16);
    struct st_file *f = st_open(p, err, sizeof err);
    cr_assert_not_null(f, "%s", err);
    st_close(f);
    /* one tensor inside another */
    tmp_path(p, sizeof p, "nested.safetensors");
    write_raw_file(p, -1,
                   "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                   "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 16);
    expect_open_error(p, "overlap");
}
