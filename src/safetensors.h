/* Reading and writing .safetensors files (the Hugging Face weight format).
 *
 * Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets},
 * "__metadata__": {...}}, then the data; data_offsets are [begin, end) relative to the data start.
 * st_open reads and validates only the header; tensor data is read on demand with pread, so a file
 * larger than memory (a 60 GB checkpoint) costs only its index. Every failure is a one-line message
 * "PATH: problem" (naming the tensor where there is one) written into err. */
#ifndef MT_SAFETENSORS_H
#define MT_SAFETENSORS_H

#include <stdbool.h>
#include <stdint.h>

#include "common.h"

enum st_dtype {
    ST_F64, ST_F32, ST_F16, ST_BF16, ST_F8_E4M3, ST_F8_E5M2,
    ST_I64, ST_I32, ST_I16, ST_I8, ST_U64, ST_U32, ST_U16, ST_U8, ST_BOOL,
    ST_DTYPE_COUNT
};

#define ST_MAX_DIMS 8

struct st_tensor {
    char *name;
    enum st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;        /* absolute byte range [begin, end) in the file */
};

struct st_file {
    char path[MT_PATH_MAX];
    int fd;
    uint64_t file_size;
    uint64_t data_start;        /* 8 + header length */
    int n;
    struct st_tensor *t;        /* [n], sorted by name (st_find bisects) */
};

/* "F32" etc. and back; st_dtype_parse returns false for a name it does not know. */
const char *st_dtype_name(enum st_dtype d);
bool st_dtype_parse(const char *s, enum st_dtype *out);
int st_dtype_size(enum st_dtype d);            /* bytes per element */

/* Opens and validates the header (sizes, JSON, every entry, byte ranges inside the file).
 * NULL + message on error. */
struct st_file *st_open(const char *path, char *err, int errcap);
void st_close(struct st_file *f);
const struct st_tensor *st_find(const struct st_file *f, const char *name);

/* Writes "[d0, d1, ...]" into buf (for messages). Returns buf. */
char *st_shape_str(int ndim, const int64_t *shape, char *buf, int cap);

/* Elements [elem0, elem0 + n) of tensor t (row-major), converted to float: F32, BF16, F16 exactly,
 * F64 rounded. Other dtypes are an error. */
bool st_read_f32_range(const struct st_file *f, const struct st_tensor *t, int64_t elem0, int64_t n,
                       float *dst, char *err, int errcap);
/* The whole tensor; n_elems must equal t->numel. */
bool st_read_f32(const struct st_file *f, const struct st_tensor *t, float *dst, int64_t n_elems,
                 char *err, int errcap);
/* The whole tensor as int64, from I64 or I32. */
bool st_read_i64(const struct st_file *f, const struct st_tensor *t, int64_t *dst, int64_t n_elems,
                 char *err, int errcap);

/* Exact scalar conversions (exposed for tests and for the GPU cast checks). */
float st_bf16_to_f32(uint16_t h);
float st_f16_to_f32(uint16_t h);          /* subnormals, inf and NaN included */
uint16_t st_f32_to_bf16(float x);         /* round to nearest even; NaN stays NaN */

/* Writer. Tensors are added with a pointer to their data, which must stay valid until
 * st_writer_finish: nothing is copied, so exporting a large model needs no second copy of it.
 * add_f32 converts float data to the stored dtype (F32 or BF16) while writing; add_raw writes the
 * bytes as given (little-endian, st_dtype_size(dtype) * numel bytes). finish writes PATH.tmp, fsyncs
 * and renames it to PATH, then frees the writer (on failure too). */
struct st_writer;
struct st_writer *st_writer_new(void);
void st_writer_add_f32(struct st_writer *w, const char *name, enum st_dtype stored, int ndim,
                       const int64_t *shape, const float *src);
void st_writer_add_raw(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                       const int64_t *shape, const void *bytes);
bool st_writer_finish(struct st_writer *w, const char *path, char *err, int errcap);
void st_writer_free(struct st_writer *w);

#endif
