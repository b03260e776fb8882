/* Config module, continued from test_config.c (suite config_hf): hf_config JSON in both spellings
 * and its precedence against YAML and --set, the config_to_yaml round trip, and the parallel
 * section's cross-field checks. Inputs are written into a fresh temporary directory per test
 * (config_test_util.h). */
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
#include "config_table.h"
#include "config_test_util.h"

#define FIXTURE_JSON "tests/fixtures/qwen3moe-tiny/config.json"

TestSuite(config_hf, .init = make_tmp, .fini = remove_tmp);

/* ---- hf_config ------------------------------------------------------------------------------ */

/* The Qwen3-30B-A3B values of spec section 1 in the transformers 4.x spelling... */
static const char *json_30b_v4 =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false,\n"
    " \"attention_dropout\": 0.0, \"bos_token_id\": 151643, \"decoder_sparse_step\": 1,\n"
    " \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\",\n"
    " \"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 6144,\n"
    " \"max_position_embeddings\": 40960, \"max_window_layers\": 48, \"mlp_only_layers\": [],\n"
    " \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 768, \"norm_topk_prob\": true,\n"
    " \"num_attention_heads\": 32, \"num_experts\": 128, \"num_experts_per_tok\": 8,\n"
    " \"num_hidden_layers\": 48, \"num_key_value_heads\": 4, \"output_router_logits\": false,\n"
    " \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, \"rope_theta\": 1000000.0,\n"
    " \"router_aux_loss_coef\": 0.001, \"sliding_window\": null, \"tie_word_embeddings\": false,\n"
    " \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.51.0\", \"use_cache\": true,\n"
    " \"use_sliding_window\": false, \"vocab_size\": 151936}\n";

/* ...and the same values as transformers 5.x writes them */
static const char *json_30b_v5 =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false,\n"
    " \"attention_dropout\": 0.0, \"decoder_sparse_step\": 1, \"dtype\": \"bfloat16\",\n"
    " \"head_dim\": 128, \"hidden_act\": \"silu\", \"hidden_size\": 2048,\n"
    " \"initializer_range\": 0.02, \"intermediate_size\": 6144, \"max_position_embeddings\": 40960,\n"
    " \"mlp_only_layers\": [], \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 768,\n"
    " \"norm_topk_prob\": true, \"num_attention_heads\": 32, \"num_experts_per_tok\": 8,\n"
    " \"num_hidden_layers\": 48, \"num_key_value_heads\": 4, \"num_local_experts\": 128,\n"
    " \"rms_norm_eps\": 1e-06,\n"
    " \"rope_parameters\": {\"rope_theta\": 1000000.0, \"rope_type\": \"default\"},\n"
    " \"router_aux_loss_coef\": 0.001, \"tie_word_embeddings\": false,\n"
    " \"transformers_version\": \"5.0.0\", \"use_sliding_window\": false, \"vocab_size\": 151936}\n";

static void read_hf(struct model_config *m, const char *path)
{
    struct config c;
    config_defaults(&c);
    *m = c.model;
    cr_assert(config_read_hf_json(m, path, errbuf, sizeof errbuf), "%s", errbuf);
}

/* Model section as YAML text, hf_config cleared (the two files have different paths). */
static char *model_text(const struct model_config *m)
{
    struct config c;
    config_defaults(&c);
    c.model = *m;
    c.model.hf_config[0] = 0;
    return body_of(&c);
}

Test(config_hf, hf_both_spellings_give_the_same_model)
{
    struct model_config a, b;
    read_hf(&a, put("v4.json", json_30b_v4));
    read_hf(&b, put("v5.json", json_30b_v5));
    char *ta = model_text(&a), *tb = model_text(&b);
    cr_assert_str_eq(ta, tb);
    free(ta), free(tb);
    /* the values themselves, from spec section 1 */
    cr_assert_eq(a.num_experts, 128);
    cr_assert_eq(a.rope_theta, 1e6);
    cr_assert_eq(a.head_dim, 128);
    cr_assert_eq(config_head_dim(&a), 128);  /* not 2048/32 = 64 */
    cr_assert(a.norm_topk_prob);
    cr_assert_eq(a.router_aux_loss_coef, 0.001);
    cr_assert_eq(a.max_position_embeddings, 40960);
}

/* The fixture (5.x spelling) rewritten by jansson into the 4.x spelling loads identically. */
Test(config_hf, hf_fixture_and_its_v4_rewrite_agree)
{
    json_error_t je;
    json_t *j = json_load_file(FIXTURE_JSON, 0, &je);
    cr_assert_not_null(j, "%s", je.text);
    cr_assert(json_object_get(j, "num_local_experts") && json_object_get(j, "rope_parameters"),
              "the fixture is expected in the 5.x spelling");
    json_t *rp = json_object_get(j, "rope_parameters");
    cr_assert_eq(json_object_set(j, "num_experts", json_object_get(j, "num_local_experts")), 0);
    cr_assert_eq(json_object_set(j, "rope_theta", json_object_get(rp, "rope_theta")), 0);
    cr_assert_eq(json_object_del(j, "num_local_experts"), 0);
    cr_assert_eq(json_object_del(j, "rope_parameters"), 0);
    char v4[PATH_MAX];
    snprintf(v4, sizeof v4, "%s/fixture_v4.json", tmpdir);
    cr_assert_eq(json_dump_file(j, v4, JSON_INDENT(2)), 0);
    json_decref(j);

    struct model_config a, b;
    read_hf(&a, FIXTURE_JSON);
    read_hf(&b, v4);
    char *ta = model_text(&a), *tb = model_text(&b);
    cr_assert_str_eq(ta, tb);
    free(ta), free(tb);
}

static int jint(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    cr_assert(json_is_integer(v), "fixture field %s", k);
    return (int)json_integer_value(v);
}

static double jnum(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    cr_assert(json_is_number(v), "fixture field %s", k);
    return json_number_value(v);
}

/* Every field compared with the fixture file read independently by jansson. */
Test(config_hf, hf_fixture_values)
{
    struct model_config m;
    read_hf(&m, FIXTURE_JSON);
    json_error_t je;
    json_t *j = json_load_file(FIXTURE_JSON, 0, &je);
    cr_assert_not_null(j);
    cr_assert_eq(m.vocab_size, jint(j, "vocab_size"));
    cr_assert_eq(m.hidden_size, jint(j, "hidden_size"));
    cr_assert_eq(m.intermediate_size, jint(j, "intermediate_size"));
    cr_assert_eq(m.moe_intermediate_size, jint(j, "moe_intermediate_size"));
    cr_assert_eq(m.num_hidden_layers, jint(j, "num_hidden_layers"));
    cr_assert_eq(m.num_attention_heads, jint(j, "num_attention_heads"));
    cr_assert_eq(m.num_key_value_heads, jint(j, "num_key_value_heads"));
    cr_assert_eq(m.head_dim, jint(j, "head_dim"));
    cr_assert_eq(m.num_experts, jint(j, "num_local_experts"));
    cr_assert_eq(m.num_experts_per_tok, jint(j, "num_experts_per_tok"));
    cr_assert_eq(m.decoder_sparse_step, jint(j, "decoder_sparse_step"));
    cr_assert_eq(m.max_position_embeddings, jint(j, "max_position_embeddings"));
    cr_assert_eq(m.norm_topk_prob, json_is_true(json_object_get(j, "norm_topk_prob")));
    cr_assert_eq(m.tie_word_embeddings, json_is_true(json_object_get(j, "tie_word_embeddings")));
    cr_assert_eq(m.rms_norm_eps, jnum(j, "rms_norm_eps"));
    cr_assert_eq(m.router_aux_loss_coef, jnum(j, "router_aux_loss_coef"));
    cr_assert_eq(m.initializer_range, jnum(j, "initializer_range"));
    cr_assert_eq(m.rope_theta, jnum(json_object_get(j, "rope_parameters"), "rope_theta"));
    cr_assert_eq((size_t)m.n_mlp_only_layers, json_array_size(json_object_get(j, "mlp_only_layers")));
    /* the fixture README: hidden 64, 8 experts, top-2 */
    cr_assert_eq(m.hidden_size, 64);
    cr_assert_eq(m.num_experts, 8);
    json_decref(j);
}

Test(config_hf, hf_defaults_when_fields_are_absent)
{
    /* norm_topk_prob, head_dim, decoder_sparse_step, tie_word_embeddings... absent: the class
     * defaults (norm_topk_prob false!), head_dim = hidden / heads */
    const char *p = put("min.json",
                        "{\"vocab_size\": 100, \"hidden_size\": 48, \"intermediate_size\": 64,\n"
                        " \"moe_intermediate_size\": 16, \"num_hidden_layers\": 3,\n"
                        " \"num_attention_heads\": 6, \"num_key_value_heads\": 2,\n"
                        " \"num_experts_per_tok\": 1, \"num_experts\": 4, \"rope_theta\": 10000}\n");
    struct model_config m;
    read_hf(&m, p);
    cr_assert_not(m.norm_topk_prob);
    cr_assert_eq(m.head_dim, 0);
    cr_assert_eq(config_head_dim(&m), 8);
    cr_assert_eq(m.decoder_sparse_step, 1);
    cr_assert_eq(m.rope_theta, 10000.0);
    cr_assert_eq(m.n_mlp_only_layers, 0);
    cr_assert_not(m.tie_word_embeddings);
}

static const char *hf_fails(const char *name, const char *extra)
{
    /* the 30B file (4.x spelling) with the fields of `extra` added or replaced */
    json_error_t je;
    json_t *j = json_loads(json_30b_v4, 0, &je);
    cr_assert_not_null(j);
    json_t *x = json_loads(extra, 0, &je);
    cr_assert_not_null(x, "%s", je.text);
    cr_assert_eq(json_object_update(j, x), 0);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    cr_assert_eq(json_dump_file(j, path, 0), 0);
    json_decref(j), json_decref(x);
    struct model_config m;
    struct config c;
    config_defaults(&c);
    m = c.model;
    cr_assert_not(config_read_hf_json(&m, path, errbuf, sizeof errbuf), "%s accepted", extra);
    cr_assert_eq(m.hidden_size, c.model.hidden_size, "a refused file must not change the struct");
    expect(errbuf, path);
    cr_assert_null(strchr(errbuf, '\n'));
    return errbuf;
}

Test(config_hf, hf_refuses_what_is_not_implemented)
{
    expect(hf_fails("a.json", "{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}"),
           "rope_scaling");
    expect(hf_fails("b.json", "{\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}}"),
           "'linear'");
    expect(hf_fails("c.json", "{\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 1e6}}"),
           "rope_parameters");
    expect(hf_fails("d.json", "{\"use_sliding_window\": true, \"sliding_window\": 4096}"),
           "use_sliding_window");
    expect(hf_fails("e.json", "{\"attention_bias\": true}"), "attention_bias");
    expect(hf_fails("f.json", "{\"hidden_act\": \"gelu\"}"), "hidden_act 'gelu'");
    expect(hf_fails("g.json", "{\"model_type\": \"qwen2_moe\"}"), "model_type 'qwen2_moe'");
    expect(hf_fails("h.json", "{\"hidden_size\": \"2048\"}"), "'hidden_size' must be an integer");
    expect(hf_fails("i.json", "{\"num_local_experts\": 64}"),
           "num_experts (128) and num_local_experts (64) disagree");
    expect(hf_fails("j.json", "{\"vocab_size\": null}"), "missing field 'vocab_size'");
    expect(hf_fails("k.json", "{\"attention_dropout\": 0.1}"), "attention_dropout");
    expect(hf_fails("l.json", "{\"rope_parameters\": {\"rope_type\": \"default\", "
                              "\"rope_theta\": 5e5}}"), "disagree");

    /* a missing model_type is fine */
    json_error_t je;
    json_t *j = json_loads(json_30b_v4, 0, &je);
    cr_assert_eq(json_object_del(j, "model_type"), 0);
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/nomt.json", tmpdir);
    cr_assert_eq(json_dump_file(j, path, 0), 0);
    json_decref(j);
    struct model_config m;
    read_hf(&m, path);
    cr_assert_eq(m.num_experts, 128);

    /* broken JSON: file:line:column */
    const char *bad = put("broken.json", "{\n  \"hidden_size\": 64,\n  oops\n}\n");
    cr_assert_not(config_read_hf_json(&m, bad, errbuf, sizeof errbuf));
    expect(errbuf, bad);
    expect(errbuf, ":3:");
    cr_assert_not(config_read_hf_json(&m, "/nonexistent/config.json", errbuf, sizeof errbuf));
    expect(errbuf, "/nonexistent/config.json");
}

Test(config_hf, hf_precedence_defaults_json_yaml_set)
{
    put("hf.json", json_30b_v4);
    char sub[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/sub", tmpdir);
    cr_assert_eq(mkdir(sub, 0755), 0);
    /* relative to the YAML file's directory, not to the working directory */
    const char *p = put("sub/run.yaml", "model:\n  hf_config: ../hf.json\n  hidden_size: 1024\n"
                                        "  num_experts_per_tok: 4\n  precision: fp32\n");
    char *sets[] = { "model.num_experts_per_tok=2" };
    struct config c;
    cr_assert(load(&c, p, 1, sets), "%s", errbuf);
    cr_assert_eq(c.model.num_experts, 128);          /* JSON over the default 8 */
    cr_assert_eq(c.model.vocab_size, 151936);        /* JSON */
    cr_assert_eq(c.model.hidden_size, 1024);         /* YAML over JSON */
    cr_assert_eq(c.model.num_experts_per_tok, 2);    /* --set over YAML over JSON */
    cr_assert_eq(c.model.precision, MT_PREC_FP32);   /* not a JSON field */
    cr_assert_eq(c.model.router_aux_loss_coef, 0.001);
    cr_assert_eq(c.model.hf_config[0], '/', "stored absolute: %s", c.model.hf_config);
    cr_assert_eq(c.train.steps, 100);                /* other sections keep their defaults */

    /* a --set hf_config is relative to the working directory */
    char *fx[] = { "model.hf_config=" FIXTURE_JSON };
    cr_assert(load(&c, NULL, 1, fx), "%s", errbuf);
    cr_assert_eq(c.model.hidden_size, 64);
    cr_assert_eq(c.model.initializer_range, 0.05);   /* the fixture's, not the default 0.02 */

    /* missing file: named with the YAML position of the key ("  hf_config: " value at 14) */
    const char *m = fails("model:\n  hf_config: nothere.json\n");
    expect_at(m, 2, 14);
    expect(m, "model.hf_config: cannot open");
    /* a problem in the merged values caused by the JSON names the JSON */
    char arg[PATH_MAX + 32];
    snprintf(arg, sizeof arg, "model.hf_config=%s/hf.json", tmpdir);
    char *heads[] = { arg, "model.num_key_value_heads=3" };
    cr_assert_not(load(&c, NULL, 2, heads));
    expect(errbuf, "--set model.num_key_value_heads: model.num_attention_heads (32) must be a "
                   "multiple of model.num_key_value_heads (3)");
    char *topk[] = { arg, "model.num_experts=4" };
    cr_assert_not(load(&c, NULL, 2, topk));
    expect(errbuf, "--set model.num_experts: model.num_experts_per_tok (8) must be <=");
}

Test(config_hf, hf_json_problem_is_blamed_on_the_json)
{
    const char *jp = put("h.json", "{\"vocab_size\": 512, \"hidden_size\": 64, \"intermediate_size\": 96,"
                                   " \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2,"
                                   " \"num_attention_heads\": 6, \"num_key_value_heads\": 4,"
                                   " \"num_experts_per_tok\": 2, \"num_experts\": 8,"
                                   " \"rope_theta\": 1e6, \"head_dim\": 16}");
    char real[PATH_MAX];
    cr_assert_not_null(realpath(jp, real));
    const char *m = fails("model:\n  hf_config: h.json\n");
    char want[PATH_MAX + 8];
    snprintf(want, sizeof want, "%s: ", real);
    cr_assert_eq(strncmp(m, want, strlen(want)), 0, "%s", m);
    expect(m, "must be a multiple of");
}

/* ---- round trip ----------------------------------------------------------------------------- */

Test(config_hf, to_yaml_round_trips)
{
    char *sets[] = {
        "checkpoint.dir=/tmp/odd \"dir\": #1\\x",
        "train.lr=0.30000000000000004",
        "train.min_lr=1e-300",
        "model.rms_norm_eps=1.2345678901234567e-7",
        "model.num_hidden_layers=4",
        "model.mlp_only_layers=[3, 0]",
        "train.seed=18446744073709551615",
        "train.load_balance=none",
        "parallel.ep_outside=yes",
        "model.hf_config=" FIXTURE_JSON,
        "checkpoint.export_hf=out/hf model",
    };
    struct config a, b;
    cr_assert(load(&a, "configs/tiny.yaml", (int)(sizeof sets / sizeof sets[0]), sets), "%s",
              errbuf);
    char *ya = yaml_of(&a);
    const char *p = put("round.yaml", ya);
    cr_assert(load(&b, p, 0, NULL), "%s\n%s", errbuf, ya);
    char *ba = body_of(&a), *bb = body_of(&b);
    cr_assert_str_eq(ba, bb);
    /* bit-exact doubles and the odd string survive */
    cr_assert_eq(b.train.lr, a.train.lr);
    cr_assert_eq(b.train.min_lr, 1e-300);
    cr_assert_eq(b.model.rms_norm_eps, a.model.rms_norm_eps);
    cr_assert_str_eq(b.checkpoint.dir, "/tmp/odd \"dir\": #1\\x");
    cr_assert_eq(b.train.seed, UINT64_MAX);
    cr_assert_eq(b.model.mlp_only_layers[0], 3);
    cr_assert_str_eq(b.model.hf_config, a.model.hf_config);
    cr_assert_str_eq(b.checkpoint.export_hf, "out/hf model");
    free(ya), free(ba), free(bb);

    /* the in-memory variant reads the same text */
    struct config s;
    char *yb = yaml_of(&b);
    cr_assert(config_load_string_checked(&s, "manifest.yaml", yb, strlen(yb), 0, NULL, errbuf,
                                         sizeof errbuf), "%s", errbuf);
    char *bs = body_of(&s), *bb2 = body_of(&b);
    cr_assert_str_eq(bs, bb2);
    free(yb), free(bs), free(bb2);
}

Test(config_hf, table_rows_are_unique)
{
    for (int i = 0; i < cfg_n_keys; i++) {
        cr_assert(cfg_section_known(cfg_keys[i].section), "%s", cfg_keys[i].section);
        for (int j = i + 1; j < cfg_n_keys; j++) {
            cr_assert(strcmp(cfg_keys[i].section, cfg_keys[j].section) != 0 ||
                      strcmp(cfg_keys[i].key, cfg_keys[j].key) != 0,
                      "%s.%s appears twice", cfg_keys[i].section, cfg_keys[i].key);
            cr_assert(cfg_keys[i].offset != cfg_keys[j].offset || cfg_keys[i].alias ||
                      cfg_keys[j].alias, "%s.%s and %s.%s share a field", cfg_keys[i].section,
                      cfg_keys[i].key, cfg_keys[j].section, cfg_keys[j].key);
        }
    }
}

Test(config_hf, to_yaml_truncates_like_snprintf)
{
    struct config c;
    config_defaults(&c);
    int n = config_to_yaml(&c, NULL, 0);
    cr_assert_gt(n, 200);
    char small[32];
    cr_assert_eq(config_to_yaml(&c, small, sizeof small), n);
    cr_assert_eq(strlen(small), sizeof small - 1);
    char *full = yaml_of(&c);
    cr_assert_eq(strncmp(full, small, sizeof small - 1), 0);
    /* every table key appears once as "  key: " */
    for (int i = 0; i < cfg_n_keys; i++) {
        if (cfg_keys[i].alias) continue;
        char want[96];
        snprintf(want, sizeof want, "\n  %s: ", cfg_keys[i].key);
        cr_assert_not_null(strstr(full, want), "%s missing", cfg_keys[i].key);
    }
    free(full);
}

/* config_load reports through mt_user_error: one line and exit status 1 */
Test(config_hf, config_load_exits_on_error, .exit_code = 1)
{
    struct config c;
    char *sets[] = { "train.steps=ten" };
    config_load(&c, NULL, 1, sets);
}

/* ---- parallel.pipeline_layers ---------------------------------------------------------------- */

Test(config_hf, pipeline_layers_one_entry_per_stage_summing_to_the_layers)
{
    struct config c;
    const char *ok = put("pl.yaml", "model:\n  num_hidden_layers: 5\nparallel:\n  pipeline_parallel_size: 2\n"
                                    "  pipeline_layers: [2, 3]\n");
    cr_assert(load(&c, ok, 0, NULL), "%s", errbuf);
    cr_assert_eq(c.parallel.n_pipeline_layers, 2);
    cr_assert(c.parallel.pipeline_layers[0] == 2 && c.parallel.pipeline_layers[1] == 3);
    /* the manifest's YAML round-trips it */
    char *y = body_of(&c);
    cr_assert_not_null(strstr(y, "pipeline_layers: [2, 3]"), "%s", y);
    free(y);

    const char *msg = fails("model:\n  num_hidden_layers: 5\nparallel:\n  pipeline_parallel_size: 2\n"
                            "  pipeline_layers: [2, 2]\n");
    expect(msg, "parallel.pipeline_layers sums to 4 layers but model.num_hidden_layers is 5");
    expect_at(msg, 5, 20);
    msg = fails("model:\n  num_hidden_layers: 5\nparallel:\n  pipeline_parallel_size: 3\n"
                "  pipeline_layers: [2, 3]\n");
    expect(msg, "parallel.pipeline_layers has 2 entries but parallel.pipeline_parallel_size is 3");
    msg = fails("model:\n  num_hidden_layers: 5\nparallel:\n  pipeline_parallel_size: 2\n"
                "  pipeline_layers: [5, 0]\n");
    expect(msg, "parallel.pipeline_layers elements must be in [1, 1024] (got 0)");
    msg = fails("parallel:\n  pipeline_layers: [1, x]\n");
    expect(msg, "parallel.pipeline_layers expects a list of integers, got element 'x'");
    /* --set, and [] restores the even split */
    char *sets[] = {"parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[1,1]"};
    cr_assert(load(&c, NULL, 2, sets), "%s", errbuf);
    cr_assert_eq(c.parallel.n_pipeline_layers, 2);
    char *sets2[] = {"parallel.pipeline_layers=[]"};
    cr_assert(load(&c, ok, 1, sets2), "%s", errbuf);
    cr_assert_eq(c.parallel.n_pipeline_layers, 0);
}

Test(config_hf, moe_chunks_must_be_positive_and_at_most_the_micro_batch_tokens)
{
    const char *m = fails("parallel:\n  moe_chunks: 0\n");
    expect(m, "parallel.moe_chunks must be >= 1 (got 0)");
    expect_at(m, 2, 15);
    expect(fails("parallel:\n  moe_chunks: -2\n"), "parallel.moe_chunks must be >= 1 (got -2)");
    const char *few = "train:\n  seq_len: 4\n  micro_batch_size: 2\n  global_batch_size: 2\nparallel:\n  moe_chunks: %d\n";
    char text[256];
    snprintf(text, sizeof text, few, 9);
    m = fails(text);
    expect(m, "parallel.moe_chunks (9) must be <= the tokens of a micro-batch");
    expect(m, "= 8)");
    snprintf(text, sizeof text, few, 8);
    struct config c;
    cr_assert(load(&c, put("ok.yaml", text), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.moe_chunks, 8);
    cr_assert(load(&c, put("default.yaml", "train:\n  steps: 1\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.moe_chunks, 1);
}

/* parallel.expert_wgrad_pairs: auto by default; true with the chunked exchange (which runs its own
 * expert backward) is refused, naming both keys; auto or false with it load. */
Test(config_hf, expert_wgrad_pairs_needs_one_moe_chunk)
{
    struct config c;
    cr_assert(load(&c, put("default.yaml", "train:\n  steps: 1\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.expert_wgrad_pairs, MT_TRI_AUTO);
    const char *m = fails("parallel:\n  expert_wgrad_pairs: true\n  moe_chunks: 2\n");
    expect(m, "parallel.expert_wgrad_pairs: true needs parallel.moe_chunks: 1");
    expect(m, "expert_wgrad_pairs");
    cr_assert(load(&c, put("a.yaml", "parallel:\n  expert_wgrad_pairs: auto\n  moe_chunks: 2\n"), 0, NULL), "%s", errbuf);
    cr_assert(load(&c, put("f.yaml", "parallel:\n  expert_wgrad_pairs: false\n  moe_chunks: 2\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.expert_wgrad_pairs, MT_TRI_FALSE);
}

/* parallel.expert_wgrad_jobs: false by default; true needs EP > 1, pairs not off and one MoE
 * chunk (each refused in one message naming the key); with EP = 2 and pairs auto it loads */
Test(config_hf, expert_wgrad_jobs_needs_ep_and_pairs)
{
    struct config c;
    cr_assert(load(&c, put("default.yaml", "train:\n  steps: 1\n"), 0, NULL), "%s", errbuf);
    cr_expect(!c.parallel.expert_wgrad_jobs);
    const char *bad[] = {"parallel:\n  expert_wgrad_jobs: true\n",
                         "parallel:\n  expert_wgrad_jobs: true\n  expert_parallel_size: 2\n  expert_wgrad_pairs: false\n",
                         "parallel:\n  expert_wgrad_jobs: true\n  expert_parallel_size: 2\n  moe_chunks: 2\n"};
    for (int i = 0; i < 3; i++) {
        const char *m = fails(bad[i]);
        expect(m, "parallel.expert_wgrad_jobs: true needs parallel.expert_parallel_size > 1");
    }
    cr_assert(load(&c, put("j.yaml", "parallel:\n  expert_wgrad_jobs: true\n  expert_parallel_size: 2\n"), 0, NULL),
              "%s", errbuf);
    cr_expect(c.parallel.expert_wgrad_jobs);
}

/* parallel.expert_wgrad_group: 0 (auto) by default, 2 to 8 micro-steps; 1 and 9 are refused */
Test(config_hf, expert_wgrad_group_range)
{
    struct config c;
    cr_assert(load(&c, put("default.yaml", "train:\n  steps: 1\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.expert_wgrad_group, 0);
    cr_assert(load(&c, put("g4.yaml", "parallel:\n  expert_wgrad_group: 4\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.expert_wgrad_group, 4);
    const char *m = fails("parallel:\n  expert_wgrad_group: 1\n");
    expect(m, "parallel.expert_wgrad_group is 2 to 8 micro-steps");
    cr_assert(load(&c, put("g8.yaml", "parallel:\n  expert_wgrad_group: 8\n"), 0, NULL), "%s", errbuf);
    cr_expect_eq(c.parallel.expert_wgrad_group, 8);
    m = fails("parallel:\n  expert_wgrad_group: 9\n");
    expect(m, "expert_wgrad_group");
}
