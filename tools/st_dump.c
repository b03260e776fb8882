/* st_dump FILE.safetensors [NAME...]: prints the header (name, dtype, shape, byte range) of a safetensors
 * file, validated the way moetrain validates it; with NAMEs, also the first values of those tensors. */
#include <stdio.h>
#include <stdlib.h>

#include "safetensors.h"

static int dump_values(const struct st_file *f, const char *name)
{
    char err[2048];
    const struct st_tensor *t = st_find(f, name);
    if (!t) {
        fprintf(stderr, "st_dump: %s: no tensor '%s'\n", f->path, name);
        return 1;
    }
    int64_t n = t->numel < 8 ? t->numel : 8;
    printf("%s:", name);
    if (t->dtype == ST_I64 || t->dtype == ST_I32) {
        int64_t *v = mt_malloc(sizeof(int64_t) * (size_t)(t->numel + 1));
        bool ok = st_read_i64(f, t, v, t->numel, err, sizeof err);
        for (int64_t i = 0; ok && i < n; i++) printf(" %lld", (long long)v[i]);
        free(v);
        if (!ok) goto fail;
    } else {
        float v[8];
        if (!st_read_f32_range(f, t, 0, n, v, err, sizeof err)) goto fail;
        for (int64_t i = 0; i < n; i++) printf(" %.9g", v[i]);
    }
    printf("%s\n", t->numel > n ? " ..." : "");
    return 0;
fail:
    printf("\n");
    fprintf(stderr, "st_dump: %s\n", err);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: st_dump FILE.safetensors [TENSOR_NAME...]\n");
        return 2;
    }
    char err[2048];
    struct st_file *f = st_open(argv[1], err, sizeof err);
    if (!f) {
        fprintf(stderr, "st_dump: %s\n", err);
        return 1;
    }
    if (argc == 2) {
        printf("%s: %d tensors, %llu bytes, data from byte %llu\n", f->path, f->n,
               (unsigned long long)f->file_size, (unsigned long long)f->data_start);
        for (int i = 0; i < f->n; i++) {
            const struct st_tensor *t = &f->t[i];
            char shape[256];
            printf("%-60s %-5s %-18s [%llu, %llu)\n", t->name, st_dtype_name(t->dtype),
                   st_shape_str(t->ndim, t->shape, shape, sizeof shape), (unsigned long long)t->begin,
                   (unsigned long long)t->end);
        }
    }
    int rc = 0;
    for (int i = 2; i < argc; i++) rc |= dump_values(f, argv[i]);
    st_close(f);
    return rc;
}
