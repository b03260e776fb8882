/* Hugging Face export (docs/export.md): the shard plan at 30B size without weights, the streaming
 * writer's files and failure behaviour, the training run's and `moetrain export`'s outputs, and the
 * round trip through a reference implementation outside moetrain (tools/qwen3_moe_ref.py). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "hf_export.h"
#include "hf_load.h"
#include "safetensors.h"
#include "tensors.h"
#include "../test_util.h"

static void load_config(struct config *c, const char *path)
{
    char err[1024];
    cr_assert(config_load_checked(c, path, 0, NULL, err, sizeof err), "%s", err);
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Qwen3-30B-A3B's table (48 layers x 128 experts, 30.5e9 parameters) planned in bf16 and fp32:
 * every offset and size is int64-correct (the totals exceed 2^31 many times over), every shard
 * holds at most 5e9 bytes of tensor data, and the hub tensors tile every table tensor exactly. */
Test(export, plan_of_a_30b_model_is_int64_correct)
{
    struct config c;
    load_config(&c, "configs/qwen3-30b-a3b.yaml");
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    int64_t params = 0;
    for (int i = 0; i < tt.n; i++) params += tt.t[i].numel;
    cr_assert_gt(params, (int64_t)30e9, "not the 30B table: %lld parameters", (long long)params);
    const int E = c.model.num_experts, L = c.model.num_hidden_layers;
    for (int dsize = 2; dsize <= 4; dsize += 2) {
        struct hf_plan p;
        hf_plan_build(&p, &tt, &c.model, true, dsize == 2 ? ST_BF16 : ST_F32, HF_EXPORT_SHARD_BYTES);
        const uint64_t want = (uint64_t)params * (uint64_t)dsize + (uint64_t)L * (uint64_t)E * 4u;
        cr_expect_eq(p.total_size, want, "total_size %llu, expected %llu", (unsigned long long)p.total_size,
                     (unsigned long long)want);
        cr_expect_gt(p.total_size, (uint64_t)INT_MAX * 16);
        uint64_t sum = 0;
        for (int k = 0; k < p.n_shards; k++) {
            cr_expect_leq(p.shard_bytes[k], HF_EXPORT_SHARD_BYTES, "shard %d holds %llu bytes", k,
                          (unsigned long long)p.shard_bytes[k]);
            sum += p.shard_bytes[k];
        }
        cr_expect_eq(sum, p.total_size);
        cr_expect_geq((uint64_t)p.n_shards, (p.total_size + HF_EXPORT_SHARD_BYTES - 1) / HF_EXPORT_SHARD_BYTES);
        cr_expect_eq(p.n, L * E * 3 + L * 9 + 3 + L, "entries: %d", p.n);
        int64_t *covered = calloc((size_t)tt.n, sizeof(int64_t));
        uint64_t at = 0;
        int shard = 0;
        for (int j = 0; j < p.n; j++) {
            const struct hf_plan_entry *e = &p.e[j];
            if (e->shard != shard) {
                cr_assert_eq(e->shard, shard + 1);
                shard++;
                at = 0;
            }
            int64_t n = 1;
            for (int d = 0; d < e->ndim; d++) n *= e->shape[d];
            cr_assert_eq(n, e->numel, "%s", e->name);
            cr_assert_eq(e->begin, at, "%s: begins at %llu, the previous ends at %llu", e->name,
                         (unsigned long long)e->begin, (unsigned long long)at);
            cr_assert_eq(e->end - e->begin, (uint64_t)e->numel * (uint64_t)st_dtype_size(e->dtype), "%s", e->name);
            at = e->end;
            if (e->tensor < 0) continue;
            const struct tensor_spec *s = &tt.t[e->tensor];
            cr_assert(e->gstart >= 0 && e->gstart + e->numel <= s->numel, "%s", e->name);
            covered[e->tensor] += e->numel;
        }
        for (int i = 0; i < tt.n; i++) cr_expect_eq(covered[i], tt.t[i].numel, "%s", tt.t[i].name);
        free(covered);
        /* the last expert's hub names exist and lie at the end of the fused tensor */
        const struct hf_plan_entry *last = NULL;
        for (int j = 0; j < p.n; j++)
            if (!strcmp(p.e[j].name, "model.layers.47.mlp.experts.127.up_proj.weight")) last = &p.e[j];
        cr_assert(last);
        cr_expect_eq(last->gstart + last->numel, tt.t[last->tensor].numel);
        cr_expect_eq(last->shape[0], 768);
        cr_expect_eq(last->shape[1], 2048);
        hf_plan_free(&p);
    }
    /* a piece fetched at a time never exceeds HF_EXPORT_CHUNK elements, far below INT_MAX */
    cr_expect_lt(HF_EXPORT_CHUNK * 4, (int64_t)INT_MAX);
    tensor_table_free(&tt);
}

/* value of element g of tensor i in the synthetic fetches below */
static float synth(int i, int64_t g) { return (float)i + (float)(g % 1000) / 1000.0f; }

struct synth_ctx {
    int calls, fail_at;
};

static bool synth_fetch(void *ctx, int tensor, int64_t gstart, int64_t n, float *dst, char *err, int errcap)
{
    struct synth_ctx *s = ctx;
    if (++s->calls == s->fail_at) {
        snprintf(err, (size_t)errcap, "synthetic read failure");
        return false;
    }
    for (int64_t j = 0; j < n; j++) dst[j] = synth(tensor, gstart + j);
    return true;
}

/* The writer on its own: several shards, an index whose total_size and weight_map match the files,
 * every element where the plan says, the bias rows, config.json; then the refusals and a failure
 * midway, which leaves neither DIR nor DIR.tmp. */
Test(export, streamed_shards_hold_every_tensor)
{
    struct config c;
    load_config(&c, "configs/tiny.yaml");
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    const int L = c.model.num_hidden_layers, E = c.model.num_experts;
    float *bias = malloc((size_t)L * E * sizeof(float));
    for (int k = 0; k < L * E; k++) bias[k] = 0.25f * (float)k;
    const char *dir = "/tmp/mt_exp_stream";
    tu_run("rm -rf /tmp/mt_exp_stream /tmp/mt_exp_stream.tmp", NULL);
    struct hf_export_opts o = {.dtype = ST_F32, .max_shard_bytes = 140000};
    struct synth_ctx sc = {0, -1};
    char err[1024];
    cr_assert(hf_export_stream(dir, &c.model, &tt, bias, &o, true, synth_fetch, &sc, err, sizeof err), "%s", err);
    cr_expect(!exists("/tmp/mt_exp_stream.tmp"));
    cr_expect(exists("/tmp/mt_exp_stream/config.json") && exists("/tmp/mt_exp_stream/generation_config.json"));

    json_error_t je;
    json_t *idx = json_load_file("/tmp/mt_exp_stream/model.safetensors.index.json", 0, &je);
    cr_assert(idx, "%s", je.text);
    json_t *map = json_object_get(idx, "weight_map");
    const char *name;
    json_t *v;
    int n_files = 0;
    uint64_t data = 0;
    char seen[64][64];
    json_object_foreach(map, name, v) {
        const char *file = json_string_value(v);
        bool dup = false;
        for (int k = 0; k < n_files && !dup; k++) dup = !strcmp(seen[k], file);
        if (dup) continue;
        cr_assert_lt(n_files, 64);
        snprintf(seen[n_files++], sizeof seen[0], "%s", file);
        char path[256];
        snprintf(path, sizeof path, "%s/%s", dir, file);
        struct st_file *f = st_open(path, err, sizeof err);
        cr_assert(f, "%s", err);
        uint64_t bytes = f->file_size - f->data_start;
        cr_expect_leq(bytes, 140000, "%s holds %llu bytes of data", file, (unsigned long long)bytes);
        data += bytes;
        st_close(f);
    }
    cr_expect_gt(n_files, 2, "only %d shards", n_files);
    cr_expect_eq((uint64_t)json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size")), data);
    json_decref(idx);

    float *buf[TG_COUNT];
    for (int g = 0; g < TG_COUNT; g++) buf[g] = calloc((size_t)tt.group_numel[g] + 1, sizeof(float));
    int unused = -1;
    cr_assert(hf_load_weights_counted(dir, &tt, buf, &unused, err, sizeof err), "%s", err);
    /* the balancing bias rows are read by hf_load_bias (below), so nothing counts as unused */
    cr_expect_eq(unused, 0, "%d tensors of the export are not used by the model", unused);
    for (int i = 0; i < tt.n; i++) {
        const float *x = buf[tensor_group_of(&tt.t[i])] + tt.t[i].offset;
        int bad = 0;
        for (int64_t g = 0; g < tt.t[i].numel; g++) bad += x[g] != synth(i, g);
        cr_expect_eq(bad, 0, "%s: %d elements differ", tt.t[i].name, bad);
    }
    float *back = malloc((size_t)L * E * sizeof(float));
    int rows = 0;
    cr_assert(hf_load_bias(dir, &c.model, back, &rows, err, sizeof err), "%s", err);
    cr_expect_eq(rows, L);
    cr_expect_eq(memcmp(back, bias, (size_t)L * E * sizeof(float)), 0);

    /* an existing directory: refused, untouched; replaced with force */
    sc.calls = 0;
    cr_expect_not(hf_export_stream(dir, &c.model, &tt, NULL, &o, true, synth_fetch, &sc, err, sizeof err));
    cr_expect(strstr(err, "already exists; refusing to overwrite it"), "%s", err);
    cr_expect(exists("/tmp/mt_exp_stream/model.safetensors.index.json"));
    o.force = true;
    o.max_shard_bytes = 0;
    cr_assert(hf_export_stream(dir, &c.model, &tt, NULL, &o, true, synth_fetch, &sc, err, sizeof err), "%s", err);
    cr_expect(exists("/tmp/mt_exp_stream/model.safetensors"));
    cr_expect(!exists("/tmp/mt_exp_stream/model.safetensors.index.json"), "the old shards were left behind");

    /* a read failure midway: no directory that looks whole, and no leftover */
    tu_run("rm -rf /tmp/mt_exp_stream", NULL);
    o.force = false;
    sc = (struct synth_ctx){0, 7};
    cr_expect_not(hf_export_stream(dir, &c.model, &tt, NULL, &o, true, synth_fetch, &sc, err, sizeof err));
    cr_expect_str_eq(err, "synthetic read failure");
    cr_expect(!exists(dir) && !exists("/tmp/mt_exp_stream.tmp"));
    cr_expect_gt(sc.calls, 7, "the fetches stopped at the failure (collective callers would hang)");

    for (int g = 0; g < TG_COUNT; g++) free(buf[g]);
    free(bias);
    free(back);
    tensor_table_free(&tt);
}

/* The training run's export on 4 ranks (EP 2 x EP_FSDP 2, bias balancing, small shards) equals,
 * file for file, `moetrain export` of the checkpoint of the same step on one process; the command's
 * refusals are one line each. */
Test(export, train_export_equals_checkpoint_export, .timeout = 300)
{
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_exp_tc && timeout 240 %s -np 4 %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=3 --set parallel.expert_parallel_size=2 --set train.load_balance=bias "
             "--set train.bias_update_rate=0.05 --set checkpoint.dir=/tmp/mt_exp_tc/ck "
             "--set checkpoint.export_hf=/tmp/mt_exp_tc/train --set checkpoint.export_shard_bytes=150000 && "
             "%s/moetrain export /tmp/mt_exp_tc/ck/step_00000003 /tmp/mt_exp_tc/conv --max-shard-bytes 150000 && "
             "ls /tmp/mt_exp_tc/train && for f in /tmp/mt_exp_tc/train/*; do cmp $f /tmp/mt_exp_tc/conv/${f##*/} || exit 1; done",
             tu_mpirun(), tu_build(), tu_build());
    int rc = tu_run(cmd, &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "model-00003-of-"), "expected at least 3 shards:\n%s", out);
    cr_expect(strstr(out, "model.safetensors.index.json"), "%s", out);
    free(out);
    const char *bad[][2] = {
        {"/tmp/mt_exp_tc/ck/step_00000003 /tmp/mt_exp_tc/conv", "/tmp/mt_exp_tc/conv: already exists; refusing"},
        {"/tmp/mt_exp_tc/ck/step_00000003 /tmp/mt_exp_tc/x --dtype fp16", "--dtype expects bf16 or fp32, got 'fp16'"},
        {"/tmp/mt_exp_tc/ck/step_00000003 /tmp/mt_exp_tc/x --max-shard-bytes 0", "--max-shard-bytes expects a positive"},
        {"/tmp/mt_exp_tc/ck /tmp/mt_exp_tc/x", "is not a complete checkpoint"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        snprintf(cmd, sizeof cmd, "%s/moetrain export %s", tu_build(), bad[k][0]);
        rc = tu_run(cmd, &out);
        cr_expect_neq(rc, 0, "%s", cmd);
        cr_expect(strstr(out, bad[k][1]), "%s:\n%s", cmd, out);
        cr_expect(strchr(out, '\n') == strrchr(out, '\n'), "not one line:\n%s", out);
        free(out);
    }
    cr_expect(!exists("/tmp/mt_exp_tc/x") && !exists("/tmp/mt_exp_tc/x.tmp"));
    snprintf(cmd, sizeof cmd, "%s/moetrain export /tmp/mt_exp_tc/ck/step_00000003 /tmp/mt_exp_tc/conv --force",
             tu_build());
    cr_expect_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    cr_expect(exists("/tmp/mt_exp_tc/conv/model.safetensors"), "bf16 of the tiny model fits one shard");
    tu_run("rm -rf /tmp/mt_exp_tc", NULL);
}

/* The numpy reference (tools/qwen3_moe_ref.py) reproduces transformers' logits and loss on every
 * fixture, so it can stand in for transformers where torch is not installed. */
Test(export, numpy_reference_matches_transformers_fixtures, .timeout = 120)
{
    const char *fx[] = {"qwen3moe-tiny", "qwen3moe-dense-mixed", "qwen3moe-untied-free", "qwen3moe-sparse-step"};
    for (size_t k = 0; k < sizeof fx / sizeof fx[0]; k++) {
        char cmd[1024], *out = NULL;
        snprintf(cmd, sizeof cmd, "python3 tools/qwen3_moe_ref.py tests/fixtures/%s --ids tests/fixtures/%s/"
                 "reference.safetensors --compare tests/fixtures/%s/reference.safetensors --tol 1e-5",
                 fx[k], fx[k], fx[k]);
        int rc = tu_run(cmd, &out);
        cr_expect_eq(rc, 0, "%s:\n%s", fx[k], out);
        cr_expect(strstr(out, "PASSED"), "%s", out);
        free(out);
    }
}

/* Round trip: train, export fp32, evaluate the export with the numpy reference outside moetrain,
 * and check moetrain's own logits and loss on the export and on the checkpoint against it to 1e-4
 * (verify --forward-only). With the balancing bias too (the reference routes with it). */
Test(export, round_trip_through_the_reference, .timeout = 300)
{
    const char *variants[] = {"", "--set train.load_balance=bias --set train.bias_update_rate=0.05"};
    for (int k = 0; k < 2; k++) {
        char cmd[4096], *out = NULL;
        snprintf(cmd, sizeof cmd,
                 "rm -rf /tmp/mt_exp_rt && %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=3 "
                 "--set checkpoint.dir=/tmp/mt_exp_rt/ck --set checkpoint.export_hf=/tmp/mt_exp_rt/hf "
                 "--set checkpoint.export_dtype=fp32 %s > /dev/null && "
                 "python3 tools/qwen3_moe_ref.py /tmp/mt_exp_rt/hf --random 2,40,11 --out /tmp/mt_exp_rt/ref.safetensors && "
                 "%s/moetrain verify /tmp/mt_exp_rt/hf /tmp/mt_exp_rt/ref.safetensors --forward-only && "
                 "%s/moetrain verify /tmp/mt_exp_rt/ck/step_00000003 /tmp/mt_exp_rt/ref.safetensors --forward-only",
                 tu_build(), variants[k], tu_build(), tu_build());
        int rc = tu_run(cmd, &out);
        cr_expect_eq(rc, 0, "variant %d:\n%s", k, out);
        const char *p = strstr(out, "PASSED");
        cr_expect(p && strstr(p + 1, "PASSED"), "%s", out);
        if (k == 1) cr_expect(strstr(out, "routing with the aux-loss-free balancing bias"), "%s", out);
        free(out);
    }
    /* a dump of input_ids and logits alone is enough; logits 1% off fail */
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "python3 -c \"from safetensors.numpy import load_file, save_file; d = load_file('/tmp/mt_exp_rt/ref.safetensors'); "
             "save_file({'input_ids': d['input_ids'], 'logits': d['logits']}, '/tmp/mt_exp_rt/bare.safetensors'); "
             "save_file({'input_ids': d['input_ids'], 'logits': d['logits'] * 1.01}, '/tmp/mt_exp_rt/off.safetensors')\" && "
             "%s/moetrain verify /tmp/mt_exp_rt/hf /tmp/mt_exp_rt/bare.safetensors --forward-only", tu_build());
    cr_expect_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "the reference has no loss") && strstr(out, "PASSED"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/moetrain verify /tmp/mt_exp_rt/hf /tmp/mt_exp_rt/off.safetensors --forward-only",
             tu_build());
    cr_expect_neq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "FAILED"), "%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_exp_rt", NULL);
}

/* The same round trip through transformers itself (Qwen3MoeForCausalLM in fp32, eager attention
 * and experts, from .venv-ref, which `make test` installs): its logits and loss on the fp32 export
 * against moetrain's on the export and on the checkpoint, to 1e-4 (verify --forward-only), and the
 * numpy reference against the same dump to 1e-5. No balancing bias: transformers' Qwen3-MoE routes
 * without one. */
Test(export, round_trip_through_transformers, .timeout = 300)
{
    const char *py = getenv("MT_REF_PYTHON");
    cr_assert(py && access(py, X_OK) == 0,
              "MT_REF_PYTHON (%s) is not an interpreter: `make test` installs torch and transformers into "
              ".venv-ref (scripts/install-deps.sh --transformers)", py ? py : "unset");
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_exp_tf && %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=3 "
             "--set checkpoint.dir=/tmp/mt_exp_tf/ck --set checkpoint.export_hf=/tmp/mt_exp_tf/hf "
             "--set checkpoint.export_dtype=fp32 > /dev/null && "
             "%s tools/qwen3_moe_ref.py /tmp/mt_exp_tf/hf --transformers --random 2,40,11 --out /tmp/mt_exp_tf/ref.safetensors && "
             "%s/moetrain verify /tmp/mt_exp_tf/hf /tmp/mt_exp_tf/ref.safetensors --forward-only && "
             "%s/moetrain verify /tmp/mt_exp_tf/ck/step_00000003 /tmp/mt_exp_tf/ref.safetensors --forward-only && "
             "python3 tools/qwen3_moe_ref.py /tmp/mt_exp_tf/hf --random 2,40,11 --compare /tmp/mt_exp_tf/ref.safetensors --tol 1e-5",
             tu_build(), py, tu_build(), tu_build());
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s", out);
    cr_expect(strstr(out, "transformers reference: batch 2x40"), "%s", out);
    const char *p = strstr(out, "PASSED");
    cr_expect(p && (p = strstr(p + 1, "PASSED")) && strstr(p + 1, "PASSED"), "three checks did not all pass:\n%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_exp_tf", NULL);
}

/* model.init_from of the export (weights and balancing bias) gives the same first-step loss as
 * model.init_from of the checkpoint the export was made from; the tokenizer files of the model
 * trained from travel into the export. */
Test(export, init_from_the_export_reproduces_the_loss, .timeout = 300)
{
    char cmd[4096], *out = NULL;
    const char *common = "configs/tiny.yaml --backend cpu --set train.load_balance=bias --set train.bias_update_rate=0.05";
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_exp_if && mkdir -p /tmp/mt_exp_if && cp -r tests/fixtures/qwen3moe-tiny /tmp/mt_exp_if/base && "
             "echo '{\"version\": \"1.0\"}' > /tmp/mt_exp_if/base/tokenizer.json && "
             "%s/moetrain train %s --set train.steps=2 --set model.init_from=/tmp/mt_exp_if/base "
             "--set checkpoint.dir=/tmp/mt_exp_if/ck --set checkpoint.export_hf=/tmp/mt_exp_if/hf "
             "--set checkpoint.export_dtype=fp32 > /dev/null && "
             "cmp /tmp/mt_exp_if/base/tokenizer.json /tmp/mt_exp_if/hf/tokenizer.json && "
             "%s/moetrain train %s --set train.steps=1 --set model.init_from=/tmp/mt_exp_if/ck/step_00000002 "
             "--set log.metrics=/tmp/mt_exp_if/a.jsonl > /dev/null && "
             "%s/moetrain train %s --set train.steps=1 --set model.init_from=/tmp/mt_exp_if/hf "
             "--set log.metrics=/tmp/mt_exp_if/b.jsonl",
             tu_build(), common, tu_build(), common, tu_build(), common);
    int rc = tu_run(cmd, &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    double a[2], b[2];
    cr_assert_eq(tu_read_metric("/tmp/mt_exp_if/a.jsonl", "loss", a, 2), 1);
    cr_assert_eq(tu_read_metric("/tmp/mt_exp_if/b.jsonl", "loss", b, 2), 1);
    cr_expect(fabs(a[0] - b[0]) <= 1e-6 * fabs(a[0]), "init_from checkpoint %.9g, export %.9g", a[0], b[0]);
    tu_run("rm -rf /tmp/mt_exp_if", NULL);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
}

/* model.init_from of a Hugging Face directory takes the shapes from its config.json (no
 * hf_config needed); a model key written in the YAML that disagrees is a one-line error naming the
 * key, its place and both values; one that agrees, or a training hyper-parameter, is accepted. */
Test(export, init_from_reads_the_shapes_of_config_json)
{
    struct config c;
    char err[1024];
    write_file("/tmp/mt_exp_cfg.yaml", "model:\n  init_from: tests/fixtures/qwen3moe-untied-free\n");
    cr_assert(config_load_checked(&c, "/tmp/mt_exp_cfg.yaml", 0, NULL, err, sizeof err), "%s", err);
    cr_expect_eq(c.model.vocab_size, 256);
    cr_expect_eq(c.model.hidden_size, 48);
    cr_expect_eq(c.model.num_experts, 8);
    cr_expect_eq(c.model.tie_word_embeddings, true);
    cr_expect_eq(c.model.norm_topk_prob, false);

    write_file("/tmp/mt_exp_cfg.yaml", "model:\n  init_from: tests/fixtures/qwen3moe-untied-free\n"
                                       "  hidden_size: 48\n  router_aux_loss_coef: 0.5\n");
    cr_assert(config_load_checked(&c, "/tmp/mt_exp_cfg.yaml", 0, NULL, err, sizeof err), "%s", err);
    cr_expect_eq(c.model.router_aux_loss_coef, 0.5);

    write_file("/tmp/mt_exp_cfg.yaml", "model:\n  init_from: tests/fixtures/qwen3moe-untied-free\n"
                                       "  hidden_size: 64\n");
    cr_assert_not(config_load_checked(&c, "/tmp/mt_exp_cfg.yaml", 0, NULL, err, sizeof err));
    cr_expect(strstr(err, "/tmp/mt_exp_cfg.yaml:3:") && strstr(err, "model.hidden_size is 64 but "
              "tests/fixtures/qwen3moe-untied-free/config.json (model.init_from) says 48"), "%s", err);
    cr_expect(!strchr(err, '\n'), "%s", err);

    char *sets[] = {"model.num_experts=4"};
    write_file("/tmp/mt_exp_cfg.yaml", "model:\n  init_from: tests/fixtures/qwen3moe-untied-free\n");
    cr_assert_not(config_load_checked(&c, "/tmp/mt_exp_cfg.yaml", 1, sets, err, sizeof err));
    cr_expect(strstr(err, "model.num_experts is 4 but"), "%s", err);

    /* the export keys: defaults, and a bad value is one line naming the key */
    cr_assert(config_load_checked(&c, "configs/tiny.yaml", 0, NULL, err, sizeof err), "%s", err);
    cr_expect_eq(c.checkpoint.export_dtype, MT_PREC_BF16);
    cr_expect_eq(c.checkpoint.export_shard_bytes, 5000000000ull);
    char *bad[] = {"checkpoint.export_dtype=fp16"};
    cr_assert_not(config_load_checked(&c, "configs/tiny.yaml", 1, bad, err, sizeof err));
    cr_expect(strstr(err, "checkpoint.export_dtype") && strstr(err, "fp16") && !strchr(err, '\n'), "%s", err);
    unlink("/tmp/mt_exp_cfg.yaml");
}

/* checkpoint.export_hf naming an existing directory stops the run before any training, on every
 * rank, with one line; train --force replaces it at the end. A balancing-bias tensor of the wrong
 * shape in an init_from directory is a one-line error naming it. */
Test(export, train_refuses_an_existing_export_and_a_bad_bias, .timeout = 120)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_exp_tr && mkdir -p /tmp/mt_exp_tr/hf && %s -np 2 %s/moetrain train configs/tiny.yaml "
             "--backend cpu --set train.steps=1 --set parallel.expert_parallel_size=2 "
             "--set checkpoint.export_hf=/tmp/mt_exp_tr/hf", tu_mpirun(), tu_build());
    cr_expect_neq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "moetrain: error: /tmp/mt_exp_tr/hf: already exists; refusing to overwrite it (remove it or "
                          "pass --force) (checkpoint.export_hf)"), "%s", out);
    cr_expect(!strstr(out, "step 1/1"), "trained first:\n%s", out);
    free(out);
    snprintf(cmd, sizeof cmd,
             "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1 --set checkpoint.export_hf=/tmp/mt_exp_tr/hf "
             "--set train.load_balance=bias --force > /dev/null && ls /tmp/mt_exp_tr/hf", tu_build());
    cr_expect_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "model.safetensors") && strstr(out, "config.json"), "%s", out);
    free(out);
    /* the bias row of layer 1 replaced by one of 3 elements */
    snprintf(cmd, sizeof cmd,
             "python3 - <<'PY'\n"
             "import json, struct, numpy as np\n"
             "from safetensors.numpy import save_file\n"
             "import sys; sys.path.insert(0, 'tools')\n"
             "from qwen3_moe_ref import read_safetensors\n"
             "d = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in read_safetensors('/tmp/mt_exp_tr/hf/model.safetensors').items()}\n"
             "d['model.layers.1.mlp.gate.e_score_correction_bias'] = np.zeros(3, np.float32)\n"
             "save_file(d, '/tmp/mt_exp_tr/hf/model.safetensors')\n"
             "PY\n"
             "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1 --set train.load_balance=bias "
             "--set model.init_from=/tmp/mt_exp_tr/hf", tu_build());
    cr_expect_neq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "tensor 'model.layers.1.mlp.gate.e_score_correction_bias' has shape [3], expected [8]"), "%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_exp_tr", NULL);
}
