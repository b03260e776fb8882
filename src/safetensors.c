#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

/* The format is little-endian and data is copied straight between file and memory. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

/* The reference implementation refuses headers above 100 MB; a larger one means a corrupt length. */
#define ST_HEADER_MAX (100ull * 1000 * 1000)
/* Elements converted per bounce-buffer pass when the stored dtype is not the destination's. */
#define ST_CHUNK ((int64_t)1 << 16)

static const struct { const char *name; int size; } dtype_info[ST_DTYPE_COUNT] = {
    [ST_F64] = {"F64", 8},   [ST_F32] = {"F32", 4},   [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2}, [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
    [ST_I64] = {"I64", 8},   [ST_I32] = {"I32", 4},   [ST_I16] = {"I16", 2}, [ST_I8] = {"I8", 1},
    [ST_U64] = {"U64", 8},   [ST_U32] = {"U32", 4},   [ST_U16] = {"U16", 2}, [ST_U8] = {"U8", 1},
    [ST_BOOL] = {"BOOL", 1},
};

const char *st_dtype_name(enum st_dtype d)
{
    return (unsigned)d < ST_DTYPE_COUNT ? dtype_info[d].name : "?";
}

int st_dtype_size(enum st_dtype d)
{
    return (unsigned)d < ST_DTYPE_COUNT ? dtype_info[d].size : 0;
}

bool st_dtype_parse(const char *s, enum st_dtype *out)
{
    for (int d = 0; d < ST_DTYPE_COUNT; d++)
        if (strcmp(s, dtype_info[d].name) == 0) {
            *out = (enum st_dtype)d;
            return true;
        }
    return false;
}

char *st_shape_str(int ndim, const int64_t *shape, char *buf, int cap)
{
    int len = snprintf(buf, (size_t)cap, "[");
    for (int i = 0; i < ndim && len < cap; i++)
        len += snprintf(buf + len, (size_t)(cap - len), "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (len < cap) snprintf(buf + len, (size_t)(cap - len), "]");
    return buf;
}

/* ---- scalar conversions ---- */

static float bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float st_bf16_to_f32(uint16_t h)
{
    return bits_to_f32((uint32_t)h << 16);
}

float st_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in float (mant < 2^10, scaling by a power of 2) */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (mant << 13));  /* inf, NaN (payload kept) */
    return bits_to_f32(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

uint16_t st_f32_to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1);  /* round to nearest, ties to even; carries into inf correctly */
    return (uint16_t)(u >> 16);
}

/* ---- reading ---- */

static bool pread_full(const char *path, int fd, void *buf, uint64_t len, uint64_t off, char *err,
                       int errcap)
{
    char *p = buf;
    while (len > 0) {
        ssize_t r = pread(fd, p, len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return mt_fail(err, errcap, "%s: read failed at byte %llu: %s", path,
                        (unsigned long long)off, strerror(errno));
        }
        if (r == 0)
            return mt_fail(err, errcap, "%s: unexpected end of file at byte %llu (file truncated?)", path,
                        (unsigned long long)off);
        p += r;
        off += (uint64_t)r;
        len -= (uint64_t)r;
    }
    return true;
}

static bool json_is_nonneg_int(const json_t *v)
{
    return json_is_integer(v) && json_integer_value(v) >= 0;
}

/* Validates one header entry and fills t (t->name is set by the caller). */
static bool parse_entry(const struct st_file *f, const char *name, json_t *v, struct st_tensor *t,
                        char *err, int errcap)
{
    const char *p = f->path;
    if (!json_is_object(v)) return mt_fail(err, errcap, "%s: tensor '%s': entry is not a JSON object", p, name);

    json_t *dt = json_object_get(v, "dtype");
    if (!dt) return mt_fail(err, errcap, "%s: tensor '%s' has no \"dtype\"", p, name);
    if (!json_is_string(dt)) return mt_fail(err, errcap, "%s: tensor '%s': \"dtype\" is not a string", p, name);
    if (!st_dtype_parse(json_string_value(dt), &t->dtype))
        return mt_fail(err, errcap, "%s: tensor '%s' has unknown dtype \"%s\"", p, name, json_string_value(dt));

    json_t *sh = json_object_get(v, "shape");
    if (!sh) return mt_fail(err, errcap, "%s: tensor '%s' has no \"shape\"", p, name);
    if (!json_is_array(sh)) return mt_fail(err, errcap, "%s: tensor '%s': \"shape\" is not a list", p, name);
    if (json_array_size(sh) > ST_MAX_DIMS)
        return mt_fail(err, errcap, "%s: tensor '%s' has %zu dimensions (at most %d supported)", p, name,
                    json_array_size(sh), ST_MAX_DIMS);
    t->ndim = (int)json_array_size(sh);
    t->numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        json_t *d = json_array_get(sh, (size_t)i);
        if (!json_is_nonneg_int(d))
            return mt_fail(err, errcap, "%s: tensor '%s': shape dimension %d is not a non-negative integer",
                        p, name, i);
        t->shape[i] = json_integer_value(d);
        if (t->shape[i] > 0 && t->numel > INT64_MAX / t->shape[i])
            return mt_fail(err, errcap, "%s: tensor '%s': shape overflows 64 bits", p, name);
        t->numel *= t->shape[i];
    }
    int esz = st_dtype_size(t->dtype);
    if (t->numel > INT64_MAX / esz)
        return mt_fail(err, errcap, "%s: tensor '%s': byte size overflows 64 bits", p, name);
    uint64_t bytes = (uint64_t)t->numel * (uint64_t)esz;

    json_t *off = json_object_get(v, "data_offsets");
    if (!off) return mt_fail(err, errcap, "%s: tensor '%s' has no \"data_offsets\"", p, name);
    if (!json_is_array(off) || json_array_size(off) != 2 || !json_is_nonneg_int(json_array_get(off, 0)) ||
        !json_is_nonneg_int(json_array_get(off, 1)))
        return mt_fail(err, errcap, "%s: tensor '%s': \"data_offsets\" is not a pair of non-negative integers",
                    p, name);
    uint64_t b = (uint64_t)json_integer_value(json_array_get(off, 0));
    uint64_t e = (uint64_t)json_integer_value(json_array_get(off, 1));
    if (b > e)
        return mt_fail(err, errcap, "%s: tensor '%s': data_offsets [%llu, %llu] end before they begin", p,
                    name, (unsigned long long)b, (unsigned long long)e);
    if (e - b != bytes) {
        char s[160];
        return mt_fail(err, errcap,
                    "%s: tensor '%s' has shape %s of %s (%llu bytes) but data_offsets [%llu, %llu] span "
                    "%llu bytes", p, name, st_shape_str(t->ndim, t->shape, s, sizeof s),
                    st_dtype_name(t->dtype), (unsigned long long)bytes, (unsigned long long)b,
                    (unsigned long long)e, (unsigned long long)(e - b));
    }
    if (e > f->file_size - f->data_start)
        return mt_fail(err, errcap,
                    "%s: tensor '%s' data ends at byte %llu but the file has only %llu bytes (truncated?)",
                    p, name, (unsigned long long)(f->data_start + e), (unsigned long long)f->file_size);
    t->begin = f->data_start + b;
    t->end = f->data_start + e;
    return true;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const struct st_tensor *)a)->name, ((const struct st_tensor *)b)->name);
}

static int cmp_tensor_begin(const void *a, const void *b)
{
    const struct st_tensor *x = a, *y = b;
    return (x->begin > y->begin) - (x->begin < y->begin);
}

/* Two tensors sharing bytes would alias each other's data (a crafted or corrupt header): refused,
 * as the safetensors format itself requires. */
static bool check_no_overlap(struct st_file *f, char *err, int errcap)
{
    struct st_tensor *by_begin = mt_malloc((size_t)MT_MAX(f->n, 1) * sizeof *by_begin);
    memcpy(by_begin, f->t, (size_t)f->n * sizeof *by_begin);
    qsort(by_begin, (size_t)f->n, sizeof *by_begin, cmp_tensor_begin);
    bool ok = true;
    const struct st_tensor *prev = NULL;
    for (int i = 0; i < f->n && ok; i++) {
        const struct st_tensor *t = &by_begin[i];
        if (t->end == t->begin) continue;
        if (prev && t->begin < prev->end)
            ok = mt_fail(err, errcap, "%s: tensors '%s' and '%s' overlap (data_offsets [%llu, %llu] and "
                      "[%llu, %llu])", f->path, prev->name, t->name,
                      (unsigned long long)(prev->begin - f->data_start),
                      (unsigned long long)(prev->end - f->data_start),
                      (unsigned long long)(t->begin - f->data_start),
                      (unsigned long long)(t->end - f->data_start));
        prev = t;
    }
    free(by_begin);
    return ok;
}

static bool read_index(struct st_file *f, char *err, int errcap)
{
    const char *p = f->path;
    struct stat stb;
    if (fstat(f->fd, &stb) != 0) return mt_fail(err, errcap, "%s: cannot stat: %s", p, strerror(errno));
    if (!S_ISREG(stb.st_mode)) return mt_fail(err, errcap, "%s: not a regular file", p);
    f->file_size = (uint64_t)stb.st_size;
    if (f->file_size < 8)
        return mt_fail(err, errcap, "%s: file is %llu bytes, too short for a safetensors header (8 bytes at least)",
                    p, (unsigned long long)f->file_size);

    unsigned char lenb[8];
    if (!pread_full(p, f->fd, lenb, 8, 0, err, errcap)) return false;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | lenb[i];
    if (hlen > f->file_size - 8)
        return mt_fail(err, errcap, "%s: header length %llu is larger than the file (%llu bytes)", p,
                    (unsigned long long)hlen, (unsigned long long)f->file_size);
    if (hlen > ST_HEADER_MAX)
        return mt_fail(err, errcap, "%s: header length %llu is implausibly large (limit %llu)", p,
                    (unsigned long long)hlen, ST_HEADER_MAX);
    f->data_start = 8 + hlen;

    char *hbuf = mt_malloc(hlen ? hlen : 1);
    if (!pread_full(p, f->fd, hbuf, hlen, 8, err, errcap)) {
        free(hbuf);
        return false;
    }
    json_error_t je;
    json_t *root = json_loadb(hbuf, hlen, JSON_REJECT_DUPLICATES, &je);
    free(hbuf);
    if (!root)
        return mt_fail(err, errcap, "%s: header is not valid JSON: %s (line %d, column %d)", p, je.text,
                    je.line, je.column);
    if (!json_is_object(root)) {
        json_decref(root);
        return mt_fail(err, errcap, "%s: header is not a JSON object", p);
    }

    f->t = mt_calloc(json_object_size(root) + 1, sizeof *f->t);
    const char *key;
    json_t *val;
    bool ok = true;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) continue;
        struct st_tensor *t = &f->t[f->n++];
        t->name = mt_strdup(key);
        if (!parse_entry(f, key, val, t, err, errcap)) {
            ok = false;
            break;
        }
    }
    json_decref(root);
    if (ok) ok = check_no_overlap(f, err, errcap);
    if (ok) qsort(f->t, (size_t)f->n, sizeof *f->t, cmp_tensor_name);
    return ok;
}

struct st_file *st_open(const char *path, char *err, int errcap)
{
    struct st_file *f = mt_calloc(1, sizeof *f);
    f->fd = -1;
    if (!mt_strlcpy(f->path, path, sizeof f->path)) {
        mt_fail(err, errcap, "%s: path too long", path);
        st_close(f);
        return NULL;
    }
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        mt_fail(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        st_close(f);
        return NULL;
    }
    if (!read_index(f, err, errcap)) {
        st_close(f);
        return NULL;
    }
    return f;
}

void st_close(struct st_file *f)
{
    if (!f) return;
    if (f->fd >= 0) close(f->fd);  /* read-only descriptor: nothing to lose if close reports an error */
    for (int i = 0; i < f->n; i++) free(f->t[i].name);
    free(f->t);
    free(f);
}

const struct st_tensor *st_find(const struct st_file *f, const char *name)
{
    struct st_tensor key = {.name = (char *)name};
    return bsearch(&key, f->t, (size_t)f->n, sizeof *f->t, cmp_tensor_name);
}

bool st_read_f32_range(const struct st_file *f, const struct st_tensor *t, int64_t elem0, int64_t n,
                       float *dst, char *err, int errcap)
{
    if (elem0 < 0 || n < 0 || elem0 > t->numel || n > t->numel - elem0)
        return mt_fail(err, errcap, "%s: tensor '%s': elements [%lld, %lld) asked for but it has %lld", f->path,
                    t->name, (long long)elem0, (long long)(elem0 + n), (long long)t->numel);
    int esz = st_dtype_size(t->dtype);
    uint64_t off = t->begin + (uint64_t)elem0 * (uint64_t)esz;
    switch (t->dtype) {
    case ST_F32:
        return pread_full(f->path, f->fd, dst, (uint64_t)n * 4, off, err, errcap);
    case ST_F64: case ST_F16: case ST_BF16:
        break;
    default:
        return mt_fail(err, errcap, "%s: tensor '%s' has dtype %s, expected a floating-point dtype", f->path,
                    t->name, st_dtype_name(t->dtype));
    }
    unsigned char *buf = mt_malloc((size_t)(MT_MIN(n, ST_CHUNK) * esz) + 1);
    for (int64_t i = 0; i < n; i += ST_CHUNK) {
        int64_t m = MT_MIN(ST_CHUNK, n - i);
        if (!pread_full(f->path, f->fd, buf, (uint64_t)(m * esz), off + (uint64_t)(i * esz), err, errcap)) {
            free(buf);
            return false;
        }
        for (int64_t j = 0; j < m; j++) {
            if (t->dtype == ST_F64) {
                double d;
                memcpy(&d, buf + 8 * j, 8);
                dst[i + j] = (float)d;
            } else {
                uint16_t h;
                memcpy(&h, buf + 2 * j, 2);
                dst[i + j] = t->dtype == ST_BF16 ? st_bf16_to_f32(h) : st_f16_to_f32(h);
            }
        }
    }
    free(buf);
    return true;
}

bool st_read_f32(const struct st_file *f, const struct st_tensor *t, float *dst, int64_t n_elems,
                 char *err, int errcap)
{
    if (n_elems != t->numel)
        return mt_fail(err, errcap, "%s: tensor '%s' has %lld elements, expected %lld", f->path, t->name,
                    (long long)t->numel, (long long)n_elems);
    return st_read_f32_range(f, t, 0, n_elems, dst, err, errcap);
}

bool st_read_i64(const struct st_file *f, const struct st_tensor *t, int64_t *dst, int64_t n_elems,
                 char *err, int errcap)
{
    if (n_elems != t->numel)
        return mt_fail(err, errcap, "%s: tensor '%s' has %lld elements, expected %lld", f->path, t->name,
                    (long long)t->numel, (long long)n_elems);
    if (t->dtype == ST_I64) return pread_full(f->path, f->fd, dst, (uint64_t)n_elems * 8, t->begin, err, errcap);
    if (t->dtype != ST_I32)
        return mt_fail(err, errcap, "%s: tensor '%s' has dtype %s, expected I64 or I32", f->path, t->name,
                    st_dtype_name(t->dtype));
    int32_t *buf = mt_malloc((size_t)MT_MIN(n_elems, ST_CHUNK) * 4 + 4);
    for (int64_t i = 0; i < n_elems; i += ST_CHUNK) {
        int64_t m = MT_MIN(ST_CHUNK, n_elems - i);
        if (!pread_full(f->path, f->fd, buf, (uint64_t)m * 4, t->begin + (uint64_t)i * 4, err, errcap)) {
            free(buf);
            return false;
        }
        for (int64_t j = 0; j < m; j++) dst[i + j] = buf[j];
    }
    free(buf);
    return true;
}

/* ---- writing ---- */

struct st_wentry {
    char *name;
    enum st_dtype dtype;         /* stored dtype */
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t numel;
    const float *f32;            /* converted while writing, or */
    const void *raw;             /* written as is */
};

struct st_writer {
    int n, cap;
    struct st_wentry *e;
};

struct st_writer *st_writer_new(void)
{
    return mt_calloc(1, sizeof(struct st_writer));
}

void st_writer_free(struct st_writer *w)
{
    if (!w) return;
    for (int i = 0; i < w->n; i++) free(w->e[i].name);
    free(w->e);
    free(w);
}

static struct st_wentry *writer_add(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                                    const int64_t *shape)
{
    if ((unsigned)dtype >= ST_DTYPE_COUNT || ndim < 0 || ndim > ST_MAX_DIMS)
        mt_fatal("st_writer_add: tensor '%s': bad dtype %d or ndim %d", name, (int)dtype, ndim);
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 64;
        w->e = mt_realloc(w->e, (size_t)w->cap * sizeof *w->e);
    }
    struct st_wentry *e = &w->e[w->n++];
    memset(e, 0, sizeof *e);
    e->name = mt_strdup(name);
    e->dtype = dtype;
    e->ndim = ndim;
    e->numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) mt_fatal("st_writer_add: tensor '%s': negative dimension", name);
        e->shape[i] = shape[i];
        e->numel *= shape[i];
    }
    return e;
}

void st_writer_add_f32(struct st_writer *w, const char *name, enum st_dtype stored, int ndim,
                       const int64_t *shape, const float *src)
{
    if (stored != ST_F32 && stored != ST_BF16)
        mt_fatal("st_writer_add_f32: tensor '%s': float data can be stored as F32 or BF16, not %s", name,
                 st_dtype_name(stored));
    writer_add(w, name, stored, ndim, shape)->f32 = src;
}

void st_writer_add_raw(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                       const int64_t *shape, const void *bytes)
{
    writer_add(w, name, dtype, ndim, shape)->raw = bytes;
}

/* The header as JSON text, padded with spaces to a multiple of 8 bytes so that data starts aligned. */
static char *writer_header(const struct st_writer *w, const char *path, size_t *len, char *err, int errcap)
{
    json_t *root = json_object();
    json_t *meta = json_object();
    MT_CHECK(root && meta, "json_object: out of memory");
    MT_CHECK(json_object_set_new(meta, "format", json_string("pt")) == 0, "json_object_set_new failed");
    MT_CHECK(json_object_set_new(root, "__metadata__", meta) == 0, "json_object_set_new failed");
    uint64_t off = 0;
    for (int i = 0; i < w->n; i++) {
        const struct st_wentry *e = &w->e[i];
        if (json_object_get(root, e->name)) {
            json_decref(root);
            mt_fail(err, errcap, "%s: tensor '%s' added twice", path, e->name);
            return NULL;
        }
        uint64_t bytes = (uint64_t)e->numel * (uint64_t)st_dtype_size(e->dtype);
        json_t *shape = json_array();
        MT_CHECK(shape, "json_array: out of memory");
        for (int d = 0; d < e->ndim; d++)
            MT_CHECK(json_array_append_new(shape, json_integer(e->shape[d])) == 0, "json_array_append_new failed");
        json_t *ent = json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_dtype_name(e->dtype), "shape", shape,
                                "data_offsets", (json_int_t)off, (json_int_t)(off + bytes));
        MT_CHECK(ent, "json_pack failed for tensor '%s'", e->name);
        MT_CHECK(json_object_set_new(root, e->name, ent) == 0, "json_object_set_new failed");
        off += bytes;
    }
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    MT_CHECK(text, "json_dumps failed");
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    char *out = mt_malloc(padded + 1);
    memcpy(out, text, n);
    memset(out + n, ' ', padded - n);
    out[padded] = 0;
    free(text);
    *len = padded;
    return out;
}

static bool write_entry(FILE *fp, const struct st_wentry *e)
{
    if (e->numel == 0) return true;
    if (e->raw) return fwrite(e->raw, (size_t)st_dtype_size(e->dtype), (size_t)e->numel, fp) == (size_t)e->numel;
    if (e->dtype == ST_F32) return fwrite(e->f32, 4, (size_t)e->numel, fp) == (size_t)e->numel;
    uint16_t *buf = mt_malloc((size_t)MT_MIN(e->numel, ST_CHUNK) * 2);
    bool ok = true;
    for (int64_t i = 0; i < e->numel && ok; i += ST_CHUNK) {
        int64_t m = MT_MIN(ST_CHUNK, e->numel - i);
        for (int64_t j = 0; j < m; j++) buf[j] = st_f32_to_bf16(e->f32[i + j]);
        ok = fwrite(buf, 2, (size_t)m, fp) == (size_t)m;
    }
    free(buf);
    return ok;
}

bool st_writer_finish(struct st_writer *w, const char *path, char *err, int errcap)
{
    char tmp[MT_PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    size_t hlen = 0;
    char *header = writer_header(w, path, &hlen, err, errcap);
    if (!header) {
        st_writer_free(w);
        return false;
    }
    bool ok = true;
    FILE *fp = fopen(tmp, "wb");
    if (!fp) {
        mt_fail(err, errcap, "%s: cannot create: %s", tmp, strerror(errno));
        free(header);
        st_writer_free(w);
        return false;
    }
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    ok = fwrite(lenb, 1, 8, fp) == 8 && fwrite(header, 1, hlen, fp) == hlen;
    for (int i = 0; i < w->n && ok; i++) ok = write_entry(fp, &w->e[i]);
    if (!ok) mt_fail(err, errcap, "%s: write failed: %s", tmp, strerror(errno));
    if (ok && (fflush(fp) != 0 || fsync(fileno(fp)) != 0)) {
        mt_fail(err, errcap, "%s: flush failed: %s", tmp, strerror(errno));
        ok = false;
    }
    if (fclose(fp) != 0 && ok) {
        mt_fail(err, errcap, "%s: close failed: %s", tmp, strerror(errno));
        ok = false;
    }
    if (ok && rename(tmp, path) != 0) {
        mt_fail(err, errcap, "%s: cannot rename %s into place: %s", path, tmp, strerror(errno));
        ok = false;
    }
    if (!ok) unlink(tmp);  /* best effort: the error already reported says what went wrong */
    free(header);
    st_writer_free(w);
    return ok;
}
