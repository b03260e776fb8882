#include "hf_export.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint_fs.h"
#include "common.h"
#include "hf_load.h"

bool hf_write_config_json(const char *path, const struct model_config *m, enum st_dtype dtype, char *err,
                          int errcap)
{
    json_t *o = json_object();
    json_t *layers = json_array();
    for (int i = 0; i < m->n_mlp_only_layers; i++) json_array_append_new(layers, json_integer(m->mlp_only_layers[i]));
#define SET(k, v) json_object_set_new(o, k, v)
    SET("architectures", json_pack("[s]", "Qwen3MoeForCausalLM"));
    SET("model_type", json_string("qwen3_moe"));
    SET("vocab_size", json_integer(m->vocab_size));
    SET("hidden_size", json_integer(m->hidden_size));
    SET("intermediate_size", json_integer(m->intermediate_size));
    SET("moe_intermediate_size", json_integer(m->moe_intermediate_size));
    SET("num_hidden_layers", json_integer(m->num_hidden_layers));
    SET("num_attention_heads", json_integer(m->num_attention_heads));
    SET("num_key_value_heads", json_integer(m->num_key_value_heads));
    SET("head_dim", json_integer(config_head_dim(m)));
    SET("num_experts", json_integer(m->num_experts));
    SET("num_experts_per_tok", json_integer(m->num_experts_per_tok));
    SET("decoder_sparse_step", json_integer(m->decoder_sparse_step));
    SET("mlp_only_layers", layers);
    SET("norm_topk_prob", json_boolean(m->norm_topk_prob));
    SET("tie_word_embeddings", json_boolean(m->tie_word_embeddings));
    SET("rope_theta", json_real(m->rope_theta));
    SET("rope_scaling", json_null());
    SET("rms_norm_eps", json_real(m->rms_norm_eps));
    SET("router_aux_loss_coef", json_real(m->router_aux_loss_coef));
    SET("initializer_range", json_real(m->initializer_range));
    SET("max_position_embeddings", json_integer(m->max_position_embeddings));
    SET("hidden_act", json_string("silu"));
    SET("attention_bias", json_false());
    SET("attention_dropout", json_real(0.0));
    SET("use_sliding_window", json_false());
    SET("output_router_logits", json_false());
    SET("torch_dtype", json_string(dtype == ST_BF16 ? "bfloat16" : "float32"));
#undef SET
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(o);
    if (rc != 0) {
        snprintf(err, (size_t)errcap, "%s: cannot write config.json: %s", path, strerror(errno));
        return false;
    }
    return true;
}



bool hf_export_check_dir(const char *dir, bool force, char *err, int errcap)
{
    struct stat st;
    if (!*dir) return mt_fail(err, errcap, "the export directory is empty");
    if (stat(dir, &st) == 0 && !force)
        return mt_fail(err, errcap, "%s: already exists; refusing to overwrite it (remove it or pass --force)", dir);
    char tmp[MT_PATH_MAX + 8];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", dir) >= (int)sizeof tmp) return mt_fail(err, errcap, "%s: path too long", dir);
    /* the parent is created as checkpoint.dir is (runs/exp1/hf in a fresh runs/exp1) */
    char parent[MT_PATH_MAX + 8];
    mt_strlcpy(parent, dir, sizeof parent);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) *slash = 0;
    if (slash && slash != parent && !ck_mkdir_p(parent))
        return mt_fail(err, errcap, "%s: cannot create the export directory: %s", dir, strerror(errno));
    if (!ck_remove_tree(tmp) || mkdir(tmp, 0777) != 0)
        return mt_fail(err, errcap, "%s: cannot create the export directory: %s", dir, strerror(errno));
    rmdir(tmp);
    return true;
}

static bool copy_file(const char *from, const char *to, char *err, int errcap)
{
    FILE *in = fopen(from, "rb");
    if (!in) return mt_fail(err, errcap, "%s: cannot read: %s", from, strerror(errno));
    FILE *out = fopen(to, "wb");
    if (!out) {
        fclose(in);
        return mt_fail(err, errcap, "%s: cannot create: %s", to, strerror(errno));
    }
    char buf[1 << 16];
    size_t n;
    bool ok = true;
    while (ok && (n = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, n, out) == n;
    ok = ok && !ferror(in);
    fclose(in);
    if (fclose(out) != 0) ok = false;
    return ok || mt_fail(err, errcap, "%s: copy to %s failed: %s", from, to, strerror(errno));
}

/* Tokenizer and generation files of the model trained from; generation_config.json is written
 * fresh when it has none. */
static bool copy_side_files(const char *tmp, const char *from, char *err, int errcap)
{
    static const char *const names[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                        "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                                        "generation_config.json"};
    char src[MT_PATH_MAX * 2], dst[MT_PATH_MAX * 2];
    bool have_gen = false;
    for (size_t i = 0; from && *from && i < sizeof names / sizeof names[0]; i++) {
        snprintf(src, sizeof src, "%s/%s", from, names[i]);
        if (access(src, R_OK) != 0) continue;
        snprintf(dst, sizeof dst, "%s/%s", tmp, names[i]);
        if (!copy_file(src, dst, err, errcap)) return false;
        have_gen |= i == sizeof names / sizeof names[0] - 1;
    }
    if (have_gen) return true;
    snprintf(dst, sizeof dst, "%s/generation_config.json", tmp);
    json_t *g = json_pack("{s:b}", "_from_model_config", 1);
    int rc = json_dump_file(g, dst, JSON_INDENT(2));
    json_decref(g);
    return rc == 0 || mt_fail(err, errcap, "%s: cannot write: %s", dst, strerror(errno));
}

static bool write_index(const char *tmp, const struct hf_plan *p, char *err, int errcap)
{
    json_t *map = json_object(), *o = json_object();
    char shard[64], path[MT_PATH_MAX * 2];
    for (int k = 0; k < p->n; k++) {
        hf_plan_shard_name(shard, sizeof shard, p->e[k].shard, p->n_shards);
        json_object_set_new(map, p->e[k].name, json_string(shard));
    }
    json_object_set_new(o, "metadata", json_pack("{s:I}", "total_size", (json_int_t)p->total_size));
    json_object_set_new(o, "weight_map", map);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", tmp);
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(o);
    return rc == 0 || mt_fail(err, errcap, "%s: cannot write: %s", path, strerror(errno));
}

/* The safetensors header of shard k, padded with spaces to a multiple of 8 bytes. */
static char *shard_header(const struct hf_plan *p, int k, size_t *len)
{
    json_t *root = json_object();
    json_object_set_new(root, "__metadata__", json_pack("{s:s}", "format", "pt"));
    for (int j = 0; j < p->n; j++) {
        const struct hf_plan_entry *e = &p->e[j];
        if (e->shard != k) continue;
        json_t *shape = json_array();
        for (int d = 0; d < e->ndim; d++) json_array_append_new(shape, json_integer(e->shape[d]));
        json_object_set_new(root, e->name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_dtype_name(e->dtype),
                                                     "shape", shape, "data_offsets", (json_int_t)e->begin,
                                                     (json_int_t)e->end));
    }
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    MT_CHECK(text, "json_dumps failed");
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    char *out = mt_realloc(text, padded + 1);
    memset(out + n, ' ', padded - n);
    out[padded] = 0;
    *len = padded;
    return out;
}

struct stream {
    const struct hf_plan *p;
    const float *bias;
    hf_fetch_fn fetch;
    void *ctx;
    bool writer;
    char *err;
    int errcap;
    float *f;                  /* [HF_EXPORT_CHUNK] fetched piece */
    uint16_t *h;               /* [HF_EXPORT_CHUNK] its bf16 form */
};

/* Writes the data of entry e into fp (NULL: this rank only takes part in the fetches, or an
 * earlier write failed and the fetches go on so that the other ranks are not left waiting). */
static bool write_entry(struct stream *s, const struct hf_plan_entry *e, FILE *fp)
{
    bool ok = true;
    for (int64_t off = 0; off < e->numel; off += HF_EXPORT_CHUNK) {
        const int64_t n = MT_MIN(HF_EXPORT_CHUNK, e->numel - off);
        const float *src = s->f;
        if (e->tensor < 0) src = s->bias + e->gstart + off;
        else if (!s->fetch(s->ctx, e->tensor, e->gstart + off, n, s->writer ? s->f : NULL, s->err, s->errcap))
            ok = false;
        if (!fp || !ok) continue;
        if (e->dtype == ST_F32) {
            ok = fwrite(src, sizeof(float), (size_t)n, fp) == (size_t)n;
        } else {
            for (int64_t j = 0; j < n; j++) s->h[j] = st_f32_to_bf16(src[j]);
            ok = fwrite(s->h, sizeof(uint16_t), (size_t)n, fp) == (size_t)n;
        }
    }
    return ok;
}

static bool write_shard(struct stream *s, const char *tmp, int k, char *err, int errcap)
{
    char name[64], path[MT_PATH_MAX * 2];
    hf_plan_shard_name(name, sizeof name, k, s->p->n_shards);
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    FILE *fp = NULL;
    bool ok = true;
    if (s->writer && *err == 0) {
        fp = fopen(path, "wb");
        if (!fp) ok = mt_fail(err, errcap, "%s: cannot create: %s", path, strerror(errno));
    }
    if (fp) {
        size_t hlen;
        char *header = shard_header(s->p, k, &hlen);
        unsigned char lenb[8];
        for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
        ok = fwrite(lenb, 1, 8, fp) == 8 && fwrite(header, 1, hlen, fp) == hlen;
        free(header);
    }
    for (int j = 0; j < s->p->n; j++)
        if (s->p->e[j].shard == k && !write_entry(s, &s->p->e[j], ok ? fp : NULL)) ok = false;
    if (fp) {
        if (ok && (fflush(fp) != 0 || fsync(fileno(fp)) != 0)) ok = false;
        if (fclose(fp) != 0) ok = false;
        if (!ok && *err == 0) mt_fail(err, errcap, "%s: write failed: %s", path, strerror(errno));
    }
    return ok;
}

bool hf_export_stream(const char *dir, const struct model_config *mc, const struct tensor_table *tt,
                      const float *bias, const struct hf_export_opts *o, bool writer, hf_fetch_fn fetch,
                      void *ctx, char *err, int errcap)
{
    struct hf_plan plan;
    hf_plan_build(&plan, tt, mc, bias != NULL, o->dtype, o->max_shard_bytes);
    char tmp[MT_PATH_MAX + 8], path[MT_PATH_MAX * 2];
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    *err = 0;
    if (writer && (!hf_export_check_dir(dir, o->force, err, errcap) || mkdir(tmp, 0777) != 0))
        if (!*err) mt_fail(err, errcap, "%s: cannot create: %s", tmp, strerror(errno));
    struct stream s = {.p = &plan, .bias = bias, .fetch = fetch, .ctx = ctx, .writer = writer, .err = err,
                       .errcap = errcap};
    if (writer) {
        s.f = mt_malloc((size_t)HF_EXPORT_CHUNK * sizeof(float));
        s.h = mt_malloc((size_t)HF_EXPORT_CHUNK * sizeof(uint16_t));
    }
    for (int k = 0; k < plan.n_shards; k++) write_shard(&s, tmp, k, err, errcap);
    free(s.f);
    free(s.h);
    bool ok = !writer || !*err;
    if (ok && writer) {
        snprintf(path, sizeof path, "%s/config.json", tmp);
        ok = (plan.n_shards == 1 || write_index(tmp, &plan, err, errcap)) &&
             hf_write_config_json(path, mc, o->dtype, err, errcap) &&
             copy_side_files(tmp, o->tokenizer_from, err, errcap);
        if (ok && o->force && !ck_remove_tree(dir))
            ok = mt_fail(err, errcap, "%s: cannot remove the old export (--force): %s", dir, strerror(errno));
        if (ok && (!ck_fsync_path(tmp) || rename(tmp, dir) != 0))
            ok = mt_fail(err, errcap, "%s: cannot rename %s into place: %s", dir, tmp, strerror(errno));
    }
    if (!ok && writer) ck_remove_tree(tmp);  /* best effort: err says what went wrong */
    hf_plan_free(&plan);
    return ok;
}

bool hf_load_bias(const char *model_dir, const struct model_config *mc, float *bias, int *found, char *err,
                  int errcap)
{
    *found = 0;
    const int E = mc->num_experts;
    memset(bias, 0, (size_t)mc->num_hidden_layers * (size_t)(E > 0 ? E : 0) * sizeof(float));
    if (E <= 0) return true;
    struct hf_source *src = hf_open(model_dir, err, errcap);
    if (!src) return false;
    bool ok = true;
    for (int l = 0; l < mc->num_hidden_layers && ok; l++) {
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        bool present = false;
        ok = hf_read_optional(src, name, E, bias + (size_t)l * E, &present, err, errcap);
        *found += present;
    }
    hf_close(src);
    return ok;
}
