#include "hf_load.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common.h"

#define HF_SINGLE "model.safetensors"
#define HF_INDEX "model.safetensors.index.json"

struct hf_file {
    char *name;            /* the weight_map's file name (sharded) or the path (single file) */
    struct st_file *f;
    bool *used;            /* [f->n]: a tensor consumed by hf_read_tensor */
};

struct hf_source {
    char path[MT_PATH_MAX];  /* the single file or the index */
    int n;
    struct hf_file *files;   /* [n] */
    json_t *index;           /* sharded only: the parsed index, owning weight_map */
    json_t *weight_map;
};

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* dir + "/" + name without doubling a trailing slash; false if it does not fit. */
static bool join_path(char *out, size_t cap, const char *dir, const char *name)
{
    size_t n = strlen(dir);
    const char *sep = n > 0 && dir[n - 1] == '/' ? "" : "/";
    int len = snprintf(out, cap, "%s%s%s", dir, sep, name);
    return len >= 0 && (size_t)len < cap;
}

static bool add_file(struct hf_source *src, const char *name, const char *path, char *err, int errcap)
{
    struct st_file *f = st_open(path, err, errcap);
    if (!f) return false;
    src->files = mt_realloc(src->files, (size_t)(src->n + 1) * sizeof *src->files);
    struct hf_file *h = &src->files[src->n++];
    h->name = mt_strdup(name);
    h->f = f;
    h->used = mt_calloc((size_t)f->n + 1, sizeof *h->used);
    return true;
}

static bool open_index(struct hf_source *src, const char *dir, char *err, int errcap)
{
    const char *ip = src->path;
    json_error_t je;
    src->index = json_load_file(ip, JSON_REJECT_DUPLICATES, &je);
    if (!src->index)
        return mt_fail(err, errcap, "%s: not valid JSON: %s (line %d, column %d)", ip, je.text, je.line,
                    je.column);
    src->weight_map = json_is_object(src->index) ? json_object_get(src->index, "weight_map") : NULL;
    if (!json_is_object(src->weight_map))
        return mt_fail(err, errcap, "%s: no \"weight_map\" object", ip);
    const char *key;
    json_t *val;
    json_object_foreach(src->weight_map, key, val) {
        if (!json_is_string(val) || json_string_length(val) == 0)
            return mt_fail(err, errcap, "%s: weight_map entry '%s' is not a file name", ip, key);
        const char *shard = json_string_value(val);
        bool seen = false;
        for (int i = 0; i < src->n && !seen; i++) seen = strcmp(src->files[i].name, shard) == 0;
        if (seen) continue;
        char path[MT_PATH_MAX];
        if (!join_path(path, sizeof path, dir, shard))
            return mt_fail(err, errcap, "%s: shard path '%s/%s' is too long", ip, dir, shard);
        char inner[MT_PATH_MAX + 256];
        if (!add_file(src, shard, path, inner, sizeof inner))
            return mt_fail(err, errcap, "%s (a shard listed in %s)", inner, ip);
    }
    if (src->n == 0) return mt_fail(err, errcap, "%s: \"weight_map\" is empty", ip);
    return true;
}

static bool open_source(struct hf_source *src, const char *model_path, char *err, int errcap)
{
    struct stat sb;
    if (stat(model_path, &sb) != 0)
        return mt_fail(err, errcap, "%s: cannot open: %s", model_path, strerror(errno));
    if (S_ISREG(sb.st_mode) && ends_with(model_path, ".json")) {
        /* an index named directly: its shards sit beside it */
        char dir[MT_PATH_MAX];
        mt_strlcpy(dir, model_path, sizeof dir);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else mt_strlcpy(dir, ".", sizeof dir);
        if (!mt_strlcpy(src->path, model_path, sizeof src->path))
            return mt_fail(err, errcap, "%s: path too long", model_path);
        return open_index(src, dir, err, errcap);
    }
    if (S_ISREG(sb.st_mode)) {
        if (!mt_strlcpy(src->path, model_path, sizeof src->path))
            return mt_fail(err, errcap, "%s: path too long", model_path);
        return add_file(src, model_path, model_path, err, errcap);
    }
    if (!S_ISDIR(sb.st_mode))
        return mt_fail(err, errcap, "%s: not a model directory or a .safetensors file", model_path);
    if (!join_path(src->path, sizeof src->path, model_path, HF_SINGLE))
        return mt_fail(err, errcap, "%s: path too long", model_path);
    if (stat(src->path, &sb) == 0) return add_file(src, src->path, src->path, err, errcap);
    if (!join_path(src->path, sizeof src->path, model_path, HF_INDEX))
        return mt_fail(err, errcap, "%s: path too long", model_path);
    if (stat(src->path, &sb) == 0) return open_index(src, model_path, err, errcap);
    return mt_fail(err, errcap, "%s: no %s or %s in this directory", model_path, HF_SINGLE, HF_INDEX);
}

struct hf_source *hf_open(const char *model_path, char *err, int errcap)
{
    struct hf_source *src = mt_calloc(1, sizeof *src);
    if (!open_source(src, model_path, err, errcap)) {
        hf_close(src);
        return NULL;
    }
    return src;
}

void hf_close(struct hf_source *src)
{
    if (!src) return;
    for (int i = 0; i < src->n; i++) {
        st_close(src->files[i].f);
        free(src->files[i].name);
        free(src->files[i].used);
    }
    free(src->files);
    json_decref(src->index);
    free(src);
}

const char *hf_source_path(const struct hf_source *src)
{
    return src->path;
}

/* The aux-free balancing bias moetrain exports beside the weights is read by hf_load_bias, not as a
 * parameter: it is not "unused". */
static bool is_balancing_bias(const char *name)
{
    const char *suffix = ".mlp.gate.e_score_correction_bias";
    size_t n = strlen(name), k = strlen(suffix);
    return n > k && !strcmp(name + n - k, suffix);
}

int hf_count_unused(const struct hf_source *src)
{
    int n = 0;
    for (int i = 0; i < src->n; i++)
        for (int j = 0; j < src->files[i].f->n; j++)
            n += !src->files[i].used[j] && !is_balancing_bias(src->files[i].f->t[j].name);
    return n;
}

/* Finds `name`. When absent, *where says which file was searched: the shard the index maps it to, or
 * NULL (the single file or the index itself). */
static const struct st_tensor *locate(const struct hf_source *src, const char *name, struct hf_file **hf,
                                      const struct hf_file **where)
{
    *where = NULL;
    if (!src->weight_map) {
        *hf = &src->files[0];
        return st_find((*hf)->f, name);
    }
    json_t *v = json_object_get(src->weight_map, name);
    if (!v) return NULL;
    for (int i = 0; i < src->n; i++)
        if (strcmp(src->files[i].name, json_string_value(v)) == 0) {
            *hf = &src->files[i];
            *where = *hf;
            return st_find((*hf)->f, name);
        }
    return NULL;  /* unreachable: open_index opened every file the map names */
}

static bool not_found(const struct hf_source *src, const char *name, const char *fused,
                      const struct hf_file *where, char *err, int errcap)
{
    char also[160] = "";
    if (fused) snprintf(also, sizeof also, " (nor the fused '%s')", fused);
    if (where)
        return mt_fail(err, errcap, "%s: tensor '%s' not found, though %s maps it to this file%s",
                    where->f->path, name, src->path, also);
    return mt_fail(err, errcap, "%s: tensor '%s' not found%s", src->path, name, also);
}

/* Reads the whole tensor `name`, which must have exactly shape [ndim] into dst. */
static bool read_exact(const struct st_tensor *t, struct hf_file *hf, int ndim,
                       const int64_t *shape, float *dst, char *err, int errcap)
{
    bool same = t->ndim == ndim;
    for (int d = 0; d < ndim && same; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char got[160], want[160];
        return mt_fail(err, errcap, "%s: tensor '%s' has shape %s, expected %s", hf->f->path, t->name,
                    st_shape_str(t->ndim, t->shape, got, sizeof got), st_shape_str(ndim, shape, want, sizeof want));
    }
    if (!st_read_f32(hf->f, t, dst, t->numel, err, errcap)) return false;
    hf->used[t - hf->f->t] = true;
    return true;
}

void hf_hub_name(char *out, size_t cap, const struct tensor_spec *s, int part, int64_t expert)
{
    if (s->kind == TK_EXPERT) snprintf(out, cap, s->hf_name[part], (int)expert);
    else snprintf(out, cap, "%s", s->hf_name[part]);
}

/* Shape of one hub part: experts [d1 / n_hf, d2] per expert; others dim 0 divided by n_hf. */
int hf_hub_shape(const struct tensor_spec *s, int64_t shape[3])
{
    if (s->kind == TK_EXPERT) {
        shape[0] = s->shape[1] / s->n_hf;
        shape[1] = s->shape[2];
        return 2;
    }
    for (int d = 0; d < s->ndim; d++) shape[d] = s->shape[d];
    shape[0] /= s->n_hf;
    return s->ndim;
}

bool hf_read_tensor(struct hf_source *src, const struct tensor_spec *s, int64_t e0, int64_t ne,
                    float *dst, char *err, int errcap)
{
    bool expert = s->kind == TK_EXPERT;
    if (!expert) { e0 = 0; ne = 1; }
    if (e0 < 0 || ne < 0 || (expert && e0 + ne > s->shape[0]))
        mt_fatal("hf_read_tensor: '%s': experts [%lld, %lld) out of range", s->name, (long long)e0,
                 (long long)(e0 + ne));
    if (ne == 0) return true;
    int64_t per_expert = expert ? s->numel / s->shape[0] : s->numel;
    char name[160];
    struct hf_file *hf;
    const struct hf_file *where;
    hf_hub_name(name, sizeof name, s, 0, e0);
    const struct st_tensor *t = locate(src, name, &hf, &where);

    if (!t) {
        /* fallback: the fused in-memory name, e.g. mlp.experts.gate_up_proj [E, 2I, H] */
        bool distinct = strcmp(name, s->name) != 0;
        const struct hf_file *where2;
        const struct st_tensor *ft = distinct ? locate(src, s->name, &hf, &where2) : NULL;
        if (!ft) return not_found(src, name, distinct ? s->name : NULL, where, err, errcap);
        int64_t e_elems = per_expert;
        bool same = ft->ndim == s->ndim;
        for (int d = 0; d < s->ndim && same; d++) same = ft->shape[d] == s->shape[d];
        if (!same) {
            char got[160], want[160];
            return mt_fail(err, errcap, "%s: tensor '%s' has shape %s, expected %s", hf->f->path, ft->name,
                        st_shape_str(ft->ndim, ft->shape, got, sizeof got),
                        st_shape_str(s->ndim, s->shape, want, sizeof want));
        }
        if (!st_read_f32_range(hf->f, ft, e0 * e_elems, ne * e_elems, dst, err, errcap)) return false;
        hf->used[ft - hf->f->t] = true;
        return true;
    }

    int64_t shape[3];
    int ndim = hf_hub_shape(s, shape);
    int64_t part_elems = per_expert / s->n_hf;
    for (int64_t e = e0; e < e0 + ne; e++)
        for (int p = 0; p < s->n_hf; p++) {
            hf_hub_name(name, sizeof name, s, p, e);
            t = locate(src, name, &hf, &where);
            if (!t) return not_found(src, name, NULL, where, err, errcap);
            float *out = dst + (e - e0) * per_expert + p * part_elems;
            if (!read_exact(t, hf, ndim, shape, out, err, errcap)) return false;
        }
    return true;
}

void hf_claim_experts(struct hf_source *src, const struct tensor_spec *s)
{
    if (s->kind != TK_EXPERT) return;
    char name[160];
    struct hf_file *hf;
    const struct hf_file *where;
    const struct st_tensor *t = locate(src, s->name, &hf, &where);
    if (t) hf->used[t - hf->f->t] = true;
    for (int64_t e = 0; e < s->shape[0]; e++)
        for (int p = 0; p < s->n_hf; p++) {
            hf_hub_name(name, sizeof name, s, p, e);
            if ((t = locate(src, name, &hf, &where)) != NULL) hf->used[t - hf->f->t] = true;
        }
}

bool hf_load_weights_counted(const char *model_dir, const struct tensor_table *tt,
                             float *const group_buf[TG_COUNT], int *n_unused, char *err, int errcap)
{
    struct hf_source *src = hf_open(model_dir, err, errcap);
    if (!src) return false;
    bool ok = true;
    for (int i = 0; i < tt->n && ok; i++) {
        const struct tensor_spec *s = &tt->t[i];
        float *dst = group_buf[tensor_group_of(s)] + s->offset;
        ok = hf_read_tensor(src, s, 0, s->kind == TK_EXPERT ? s->shape[0] : 1, dst, err, errcap);
    }
    if (ok && n_unused) *n_unused = hf_count_unused(src);
    hf_close(src);
    return ok;
}

bool hf_load_weights(const char *model_dir, const struct tensor_table *tt, float *const group_buf[TG_COUNT],
                     char *err, int errcap)
{
    int unused = 0;
    if (!hf_load_weights_counted(model_dir, tt, group_buf, &unused, err, errcap)) return false;
    if (unused > 0)
        mt_warn0("%s: %d tensor%s in the weight files not used by this model (ignored)", model_dir, unused,
                 unused == 1 ? "" : "s");
    return true;
}

bool hf_save_weights(const char *model_dir_or_file, const struct tensor_table *tt,
                     const float *const group_buf[TG_COUNT], const char *dtype, char *err, int errcap)
{
    enum st_dtype stored;
    if (strcmp(dtype, "F32") == 0) stored = ST_F32;
    else if (strcmp(dtype, "BF16") == 0) stored = ST_BF16;
    else return mt_fail(err, errcap, "%s: cannot save weights as dtype \"%s\" (F32 or BF16)", model_dir_or_file, dtype);

    char path[MT_PATH_MAX];
    if (ends_with(model_dir_or_file, ".safetensors")) {
        if (!mt_strlcpy(path, model_dir_or_file, sizeof path))
            return mt_fail(err, errcap, "%s: path too long", model_dir_or_file);
    } else {
        if (mkdir(model_dir_or_file, 0777) != 0 && errno != EEXIST)
            return mt_fail(err, errcap, "%s: cannot create directory: %s", model_dir_or_file, strerror(errno));
        if (!join_path(path, sizeof path, model_dir_or_file, HF_SINGLE))
            return mt_fail(err, errcap, "%s: path too long", model_dir_or_file);
    }

    struct st_writer *w = st_writer_new();
    char name[160];
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        const float *base = group_buf[tensor_group_of(s)] + s->offset;
        int64_t shape[3];
        int ndim = hf_hub_shape(s, shape);
        int64_t n_exp = s->kind == TK_EXPERT ? s->shape[0] : 1;
        int64_t per_expert = s->numel / n_exp, part_elems = per_expert / s->n_hf;
        for (int64_t e = 0; e < n_exp; e++)
            for (int p = 0; p < s->n_hf; p++) {
                hf_hub_name(name, sizeof name, s, p, e);
                st_writer_add_f32(w, name, stored, ndim, shape, base + e * per_expert + p * part_elems);
            }
    }
    return st_writer_finish(w, path, err, errcap);
}

bool hf_read_optional(struct hf_source *src, const char *name, int64_t n, float *dst, bool *present, char *err,
                      int errcap)
{
    struct hf_file *hf;
    const struct hf_file *where;
    const struct st_tensor *t = locate(src, name, &hf, &where);
    *present = t != NULL;
    if (!t) return true;
    const int64_t shape[1] = {n};
    return read_exact(t, hf, 1, shape, dst, err, errcap);
}
