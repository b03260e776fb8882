/* Loading Hugging Face weights into the table's flat buffers, checked tensor by tensor against the
 * transformers reference dump (param.NAME, fused in-memory layout, independent of this code). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hf_load.h"

#define FIXTURE "tests/fixtures/qwen3moe-tiny"

static char tmpdir[256];
static char err[2048];
static struct model_config cfg;
static struct tensor_table tt;
static float *buf[TG_COUNT];

/* The fixture's config.json, by hand. */
static void fixture_config(struct model_config *m)
{
    memset(m, 0, sizeof *m);
    m->vocab_size = 512;
    m->hidden_size = 64;
    m->intermediate_size = 96;
    m->moe_intermediate_size = 32;
    m->num_hidden_layers = 2;
    m->num_attention_heads = 4;
    m->num_key_value_heads = 2;
    m->head_dim = 16;
    m->num_experts = 8;
    m->num_experts_per_tok = 2;
    m->norm_topk_prob = true;
    m->decoder_sparse_step = 1;
    m->n_mlp_only_layers = 0;
    m->tie_word_embeddings = false;
    m->train_router = true;
    m->rope_theta = 1e6;
    m->rms_norm_eps = 1e-6;
    m->router_aux_loss_coef = 0.01;
}

static float **alloc_bufs(const struct tensor_table *t, float **b)
{
    for (int g = 0; g < TG_COUNT; g++) b[g] = calloc((size_t)t->group_numel[g] + 1, sizeof(float));
    return b;
}

static void setup(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/mt_hf_XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir));
    fixture_config(&cfg);
    tensor_table_build(&tt, &cfg);
    alloc_bufs(&tt, buf);
}

static void teardown(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (tmpdir[0] && system(cmd) != 0) cr_log_warn("could not remove %s", tmpdir);
    for (int g = 0; g < TG_COUNT; g++) free(buf[g]);
    tensor_table_free(&tt);
}

TestSuite(hf_load, .init = setup, .fini = teardown);

static void tmp_path(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", tmpdir, name);
}

static float *tensor_ptr(float **b, const struct tensor_spec *s)
{
    return b[tensor_group_of(s)] + s->offset;
}

static void expect_one_line_naming(const char *what)
{
    cr_assert_not_null(strstr(err, what), "error does not name '%s': %s", what, err);
    cr_assert_null(strchr(err, '\n'), "error is not one line: %s", err);
}

/* Every tensor of the table equals param.<name> in the reference dump. */
static void check_against_reference(float **b)
{
    struct st_file *r = st_open(FIXTURE "/reference.safetensors", err, sizeof err);
    cr_assert_not_null(r, "%s", err);
    for (int i = 0; i < tt.n; i++) {
        const struct tensor_spec *s = &tt.t[i];
        char name[160];
        snprintf(name, sizeof name, "param.%s", s->name);
        const struct st_tensor *t = st_find(r, name);
        cr_assert_not_null(t, "reference has no %s", name);
        cr_assert_eq(t->ndim, s->ndim, "%s", name);
        for (int d = 0; d < s->ndim; d++) cr_assert_eq(t->shape[d], s->shape[d], "%s dim %d", name, d);
        float *ref = malloc(sizeof(float) * s->numel);
        cr_assert(st_read_f32(r, t, ref, s->numel, err, sizeof err), "%s", err);
        const float *got = tensor_ptr(b, s);
        for (int64_t k = 0; k < s->numel; k++)
            cr_assert_eq(got[k], ref[k], "%s[%lld]: loaded %g, reference %g", s->name, (long long)k, got[k], ref[k]);
        free(ref);
    }
    st_close(r);
}

Test(hf_load, fixture_matches_reference)
{
    cr_assert_eq(tt.n, 3 + 2 * 11, "table size %d", tt.n);
    int unused = -1;
    cr_assert(hf_load_weights_counted(FIXTURE, &tt, buf, &unused, err, sizeof err), "%s", err);
    cr_assert_eq(unused, 0);
    check_against_reference(buf);
    /* the plain entry point and a path to the file itself load the same */
    float *b2[TG_COUNT];
    alloc_bufs(&tt, b2);
    cr_assert(hf_load_weights(FIXTURE "/model.safetensors", &tt, b2, err, sizeof err), "%s", err);
    for (int g = 0; g < TG_COUNT; g++) {
        cr_assert_eq(memcmp(buf[g], b2[g], sizeof(float) * tt.group_numel[g]), 0);
        free(b2[g]);
    }
}

/* All tensors of the fixture's hub file, to rewrite into variants. */
struct tensor_set {
    int n;
    char **name;
    int *ndim;
    int64_t (*shape)[8];
    float **data;
};

static void load_set(struct tensor_set *ts, const char *path)
{
    struct st_file *f = st_open(path, err, sizeof err);
    cr_assert_not_null(f, "%s", err);
    ts->n = f->n;
    ts->name = calloc((size_t)f->n, sizeof *ts->name);
    ts->ndim = calloc((size_t)f->n, sizeof *ts->ndim);
    ts->shape = calloc((size_t)f->n, sizeof *ts->shape);
    ts->data = calloc((size_t)f->n, sizeof *ts->data);
    for (int i = 0; i < f->n; i++) {
        const struct st_tensor *t = &f->t[i];
        ts->name[i] = strdup(t->name);
        ts->ndim[i] = t->ndim;
        memcpy(ts->shape[i], t->shape, sizeof ts->shape[i]);
        ts->data[i] = malloc(sizeof(float) * (size_t)(t->numel + 1));
        cr_assert(st_read_f32(f, t, ts->data[i], t->numel, err, sizeof err), "%s", err);
    }
    st_close(f);
}

static void free_set(struct tensor_set *ts)
{
    for (int i = 0; i < ts->n; i++) {
        free(ts->name[i]);
        free(ts->data[i]);
    }
    free(ts->name);
    free(ts->ndim);
    free(ts->shape);
    free(ts->data);
}

/* Writes tensors [i0, i1) of ts, leaving out `skip` and narrowing the last dim of `narrow` by one. */
static void write_set(const struct tensor_set *ts, int i0, int i1, const char *path, const char *skip,
                      const char *narrow)
{
    struct st_writer *w = st_writer_new();
    for (int i = i0; i < i1; i++) {
        if (skip && strcmp(ts->name[i], skip) == 0) continue;
        int64_t shape[8];
        memcpy(shape, ts->shape[i], sizeof shape);
        if (narrow && strcmp(ts->name[i], narrow) == 0) shape[ts->ndim[i] - 1] -= 1;
        st_writer_add_f32(w, ts->name[i], ST_F32, ts->ndim[i], shape, ts->data[i]);
    }
    cr_assert(st_writer_finish(w, path, err, sizeof err), "%s", err);
}

/* Two shards (tensors [0, split) and [split, n)) plus an index; extra_name, if given, adds a map entry to extra_file. */
static void write_sharded(const struct tensor_set *ts, const char *dir, const char *extra_name,
                          const char *extra_file)
{
    char path[600];
    int split = ts->n / 2;
    const char *shard[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    json_t *map = json_object();
    for (int s = 0; s < 2; s++) {
        snprintf(path, sizeof path, "%s/%s", dir, shard[s]);
        write_set(ts, s ? split : 0, s ? ts->n : split, path, NULL, NULL);
        for (int i = s ? split : 0; i < (s ? ts->n : split); i++)
            cr_assert_eq(json_object_set_new(map, ts->name[i], json_string(shard[s])), 0);
    }
    if (extra_name) cr_assert_eq(json_object_set_new(map, extra_name, json_string(extra_file)), 0);
    json_t *root = json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)0, "weight_map", map);
    cr_assert_not_null(root);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    cr_assert_eq(json_dump_file(root, path, JSON_INDENT(2)), 0);
    json_decref(root);
}

Test(hf_load, sharded_directory_loads_identically)
{
    cr_assert(hf_load_weights(FIXTURE, &tt, buf, err, sizeof err), "%s", err);
    struct tensor_set ts;
    load_set(&ts, FIXTURE "/model.safetensors");
    write_sharded(&ts, tmpdir, NULL, NULL);
    float *b2[TG_COUNT];
    alloc_bufs(&tt, b2);
    int unused = -1;
    cr_assert(hf_load_weights_counted(tmpdir, &tt, b2, &unused, err, sizeof err), "%s", err);
    cr_assert_eq(unused, 0);
    for (int g = 0; g < TG_COUNT; g++) {
        cr_assert_eq(memcmp(buf[g], b2[g], sizeof(float) * tt.group_numel[g]), 0, "group %d differs", g);
        memset(b2[g], 0, sizeof(float) * tt.group_numel[g]);
    }
    /* the index file named directly */
    char path[600];
    tmp_path(path, sizeof path, "model.safetensors.index.json");
    cr_assert(hf_load_weights(path, &tt, b2, err, sizeof err), "%s", err);
    for (int g = 0; g < TG_COUNT; g++) {
        cr_assert_eq(memcmp(buf[g], b2[g], sizeof(float) * tt.group_numel[g]), 0, "group %d differs", g);
        free(b2[g]);
    }
    free_set(&ts);
}

Test(hf_load, missing_tensor)
{
    struct tensor_set ts;
    load_set(&ts, FIXTURE "/model.safetensors");
    char path[600];
    tmp_path(path, sizeof path, "model.safetensors");
    const char *gone = "model.layers.1.mlp.experts.5.up_proj.weight";
    write_set(&ts, 0, ts.n, path, gone, NULL);
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming(gone);
    expect_one_line_naming(path);

    /* a plain (unfused) tensor too */
    write_set(&ts, 0, ts.n, path, "model.norm.weight", NULL);
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming("'model.norm.weight' not found");
    free_set(&ts);
}

Test(hf_load, wrong_shape)
{
    struct tensor_set ts;
    load_set(&ts, FIXTURE "/model.safetensors");
    char want[1024];
    snprintf(want, sizeof want,
             "%s/model.safetensors: tensor 'model.layers.0.mlp.experts.3.up_proj.weight' has shape [32, 63], "
             "expected [32, 64]", tmpdir);
    char path[600];
    tmp_path(path, sizeof path, "model.safetensors");
    write_set(&ts, 0, ts.n, path, NULL, "model.layers.0.mlp.experts.3.up_proj.weight");
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    cr_assert_str_eq(err, want);

    write_set(&ts, 0, ts.n, path, NULL, "model.layers.1.self_attn.q_norm.weight");
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming("'model.layers.1.self_attn.q_norm.weight' has shape [15], expected [16]");
    free_set(&ts);
}

Test(hf_load, sharded_errors)
{
    struct tensor_set ts;
    load_set(&ts, FIXTURE "/model.safetensors");
    char path[600];

    /* the index names a shard that is not there */
    write_sharded(&ts, tmpdir, "model.extra.weight", "model-00003-of-00002.safetensors");
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming("model-00003-of-00002.safetensors");
    expect_one_line_naming("cannot open");

    /* a truncated shard */
    write_sharded(&ts, tmpdir, NULL, NULL);
    tmp_path(path, sizeof path, "model-00002-of-00002.safetensors");
    FILE *fp = fopen(path, "rb");
    cr_assert(fp && fseek(fp, 0, SEEK_END) == 0);
    long size = ftell(fp);
    cr_assert_eq(fclose(fp), 0);
    cr_assert_eq(truncate(path, size - 1000), 0);
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming(path);
    expect_one_line_naming("truncated");

    /* the index maps a tensor to a shard that does not hold it */
    write_sharded(&ts, tmpdir, NULL, NULL);
    const char *moved = "model.layers.1.self_attn.v_proj.weight";
    json_error_t je;
    tmp_path(path, sizeof path, "model.safetensors.index.json");
    json_t *root = json_load_file(path, 0, &je);
    cr_assert_not_null(root);
    const char *actual = json_string_value(json_object_get(json_object_get(root, "weight_map"), moved));
    const char *other = strcmp(actual, "model-00001-of-00002.safetensors") == 0 ? "model-00002-of-00002.safetensors"
                                                                               : "model-00001-of-00002.safetensors";
    cr_assert_eq(json_object_set_new(json_object_get(root, "weight_map"), moved, json_string(other)), 0);
    cr_assert_eq(json_dump_file(root, path, 0), 0);
    json_decref(root);
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming(moved);
    expect_one_line_naming(other);

    /* the index lacks the tensor altogether */
    root = json_load_file(path, 0, &je);
    cr_assert_eq(json_object_del(json_object_get(root, "weight_map"), moved), 0);
    cr_assert_eq(json_dump_file(root, path, 0), 0);
    json_decref(root);
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming(moved);
    expect_one_line_naming(path);

    /* an index that is not JSON */
    fp = fopen(path, "w");
    cr_assert(fp && fputs("{\"weight_map\": {", fp) >= 0 && fclose(fp) == 0);
    cr_assert_not(hf_load_weights(tmpdir, &tt, buf, err, sizeof err));
    expect_one_line_naming(path);
    expect_one_line_naming("not valid JSON");
    free_set(&ts);

    /* a directory with no weights */
    char empty[600];
    tmp_path(empty, sizeof empty, "empty");
    cr_assert_eq(mkdir(empty, 0777), 0);
    cr_assert_not(hf_load_weights(empty, &tt, buf, err, sizeof err));
    expect_one_line_naming(empty);
    expect_one_line_naming("model.safetensors");
    tmp_path(empty, sizeof empty, "nowhere");
    cr_assert_not(hf_load_weights(empty, &tt, buf, err, sizeof err));
    expect_one_line_naming(empty);
}

static void check_expert_subset(const char *path, int gu, int dn);

/* A file in the fused in-memory layout (the reference's param.* renamed), plus a tensor nobody uses. */
Test(hf_load, fused_names_and_extra_tensors)
{
    struct st_file *r = st_open(FIXTURE "/reference.safetensors", err, sizeof err);
    cr_assert_not_null(r, "%s", err);
    struct st_writer *w = st_writer_new();
    float *data[64];
    int nd = 0;
    for (int i = 0; i < r->n; i++) {
        const struct st_tensor *t = &r->t[i];
        if (strncmp(t->name, "param.", 6) != 0) continue;
        cr_assert_lt(nd, 64);
        data[nd] = malloc(sizeof(float) * t->numel);
        cr_assert(st_read_f32(r, t, data[nd], t->numel, err, sizeof err), "%s", err);
        st_writer_add_f32(w, t->name + 6, ST_F32, t->ndim, t->shape, data[nd]);
        nd++;
    }
    float inv_freq[8] = {0};
    int64_t s8[1] = {8};
    st_writer_add_f32(w, "model.rotary_emb.inv_freq", ST_F32, 1, s8, inv_freq);
    char path[600];
    tmp_path(path, sizeof path, "model.safetensors");
    cr_assert(st_writer_finish(w, path, err, sizeof err), "%s", err);
    st_close(r);
    for (int i = 0; i < nd; i++) free(data[i]);

    int unused = -1;
    cr_assert(hf_load_weights_counted(tmpdir, &tt, buf, &unused, err, sizeof err), "%s", err);
    cr_assert_eq(unused, 1);
    check_against_reference(buf);
    check_expert_subset(tmpdir, tensor_lookup(&tt, TR_EXP_GATE_UP, 0), tensor_lookup(&tt, TR_EXP_DOWN, 1));
}

/* Experts [2, 5) of tensors gu and dn read from `path` equal those of the full load in buf. */
static void check_expert_subset(const char *path, int gu, int dn)
{
    struct hf_source *src = hf_open(path, err, sizeof err);
    cr_assert_not_null(src, "%s", err);
    const int idx[2] = {gu, dn};
    for (int j = 0; j < 2; j++) {
        const struct tensor_spec *s = &tt.t[idx[j]];
        int64_t per = s->numel / s->shape[0];
        float *part = malloc(sizeof(float) * 3 * per);
        cr_assert(hf_read_tensor(src, s, 2, 3, part, err, sizeof err), "%s", err);
        cr_assert_eq(memcmp(part, tensor_ptr(buf, s) + 2 * per, sizeof(float) * 3 * per), 0, "%s", s->name);
        free(part);
    }
    hf_close(src);
}

/* Reading only some experts (what a rank of an EP group needs), from hub and from fused files. */
Test(hf_load, expert_subset)
{
    cr_assert(hf_load_weights(FIXTURE, &tt, buf, err, sizeof err), "%s", err);
    int gu = tensor_lookup(&tt, TR_EXP_GATE_UP, 1), dn = tensor_lookup(&tt, TR_EXP_DOWN, 0);
    cr_assert(gu >= 0 && dn >= 0);
    check_expert_subset(FIXTURE, gu, dn);
}

Test(hf_load, tied_embeddings_skip_lm_head)
{
    struct model_config tied = cfg;
    tied.tie_word_embeddings = true;
    struct tensor_table t2;
    tensor_table_build(&t2, &tied);
    cr_assert_eq(tensor_find(&t2, "lm_head.weight"), -1);
    float *b2[TG_COUNT];
    alloc_bufs(&t2, b2);
    int unused = -1;
    cr_assert(hf_load_weights_counted(FIXTURE, &t2, b2, &unused, err, sizeof err), "%s", err);
    cr_assert_eq(unused, 1, "the file's lm_head is left over");
    for (int g = 0; g < TG_COUNT; g++) free(b2[g]);
    tensor_table_free(&t2);
}

Test(hf_load, save_load_round_trip)
{
    cr_assert(hf_load_weights(FIXTURE, &tt, buf, err, sizeof err), "%s", err);
    const float *cbuf[TG_COUNT] = {buf[0], buf[1]};
    char dir[600], path[700];
    float *b2[TG_COUNT];
    alloc_bufs(&tt, b2);

    tmp_path(dir, sizeof dir, "f32");
    cr_assert(hf_save_weights(dir, &tt, cbuf, "F32", err, sizeof err), "%s", err);
    int unused = -1;
    cr_assert(hf_load_weights_counted(dir, &tt, b2, &unused, err, sizeof err), "%s", err);
    cr_assert_eq(unused, 0);
    for (int g = 0; g < TG_COUNT; g++)
        cr_assert_eq(memcmp(buf[g], b2[g], sizeof(float) * tt.group_numel[g]), 0, "F32 round trip, group %d", g);

    /* the saved file has the hub names and shapes of the original, tensor for tensor */
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    struct st_file *a = st_open(path, err, sizeof err), *o = st_open(FIXTURE "/model.safetensors", err, sizeof err);
    cr_assert(a && o, "%s", err);
    cr_assert_eq(a->n, o->n);
    for (int i = 0; i < o->n; i++) {
        cr_assert_str_eq(a->t[i].name, o->t[i].name);
        cr_assert_eq(a->t[i].ndim, o->t[i].ndim);
        cr_assert_eq(memcmp(a->t[i].shape, o->t[i].shape, sizeof(int64_t) * o->t[i].ndim), 0, "%s", o->t[i].name);
    }
    st_close(a);
    st_close(o);

    tmp_path(path, sizeof path, "bf16.safetensors");
    cr_assert(hf_save_weights(path, &tt, cbuf, "BF16", err, sizeof err), "%s", err);
    struct st_file *f = st_open(path, err, sizeof err);
    cr_assert_not_null(f, "%s", err);
    const struct st_tensor *t = st_find(f, "model.layers.0.mlp.experts.5.gate_proj.weight");
    cr_assert(t && t->dtype == ST_BF16);
    st_close(f);
    cr_assert(hf_load_weights(path, &tt, b2, err, sizeof err), "%s", err);
    for (int g = 0; g < TG_COUNT; g++)
        for (int64_t i = 0; i < tt.group_numel[g]; i++) {
            float x = buf[g][i], y = b2[g][i];
            cr_assert_leq(fabsf(x - y), fabsf(x) * 0x1p-8f, "BF16 round trip, group %d [%lld]: %g vs %g", g,
                          (long long)i, x, y);
        }
    cr_assert_not(hf_save_weights(path, &tt, cbuf, "F16", err, sizeof err));
    expect_one_line_naming("F16");
    for (int g = 0; g < TG_COUNT; g++) free(b2[g]);
}
