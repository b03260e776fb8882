/* Config module: defaults, YAML loading with file:line:column errors, --set and validation;
 * test_config_hf.c: hf_config JSON in both spellings, the config_to_yaml round trip and the
 * parallel section's cross-field checks. YAML/JSON inputs are written into a fresh temporary
 * directory per test (config_test_util.h). Expected error positions are counted by hand from the
 * 1-based line and column of the offending token in the literal text (explained next to each). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "config_table.h"
#include "config_test_util.h"

TestSuite(config, .init = make_tmp, .fini = remove_tmp);

/* ---- defaults ------------------------------------------------------------------------------- */

Test(config, defaults_are_the_tiny_model)
{
    struct config c;
    config_defaults(&c);
    cr_assert_eq(c.model.vocab_size, 512);
    cr_assert_eq(c.model.hidden_size, 64);
    cr_assert_eq(c.model.num_hidden_layers, 2);
    cr_assert_eq(c.model.num_attention_heads, 4);
    cr_assert_eq(c.model.num_key_value_heads, 2);
    cr_assert_eq(c.model.head_dim, 16);
    cr_assert_eq(c.model.num_experts, 8);
    cr_assert_eq(c.model.num_experts_per_tok, 2);
    cr_assert_eq(c.model.moe_intermediate_size, 32);
    cr_assert_eq(c.model.intermediate_size, 96);
    cr_assert_eq(c.model.decoder_sparse_step, 1);
    cr_assert_eq(c.model.n_mlp_only_layers, 0);
    cr_assert(c.model.norm_topk_prob);
    cr_assert_not(c.model.tie_word_embeddings);
    cr_assert_eq(c.model.rope_theta, 1e6);
    cr_assert_eq(c.model.rms_norm_eps, 1e-6);
    cr_assert_eq(c.model.router_aux_loss_coef, 0.01);
    cr_assert_eq(c.model.initializer_range, 0.02);
    cr_assert_eq(c.model.max_position_embeddings, 4096);
    cr_assert_eq(c.model.precision, MT_PREC_BF16);
    cr_assert(c.model.router_fp32 && c.model.train_router && !c.model.freeze_router);
    cr_assert_eq(c.parallel.pipeline_parallel_size, 1);
    cr_assert_eq(c.parallel.expert_parallel_size, 1);
    cr_assert_eq(c.parallel.backend, MT_BACKEND_AUTO);
    cr_assert_eq(c.train.steps, 100);
    cr_assert_eq(c.train.seq_len, 64);
    cr_assert_eq(c.train.global_batch_size, 8);
    cr_assert_eq(c.train.micro_batch_size, 2);
    cr_assert_eq(c.train.lr, 3e-3);
    cr_assert_eq(c.train.min_lr, 3e-4);
    cr_assert_eq(c.train.warmup_steps, 10);
    cr_assert_eq(c.train.weight_decay, 0.1);
    cr_assert_eq(c.train.beta1, 0.9);
    cr_assert_eq(c.train.beta2, 0.95);
    cr_assert_eq(c.train.adam_eps, 1e-8);
    cr_assert_eq(c.train.grad_clip, 1.0);
    cr_assert_eq(c.train.seed, 1234);
    cr_assert_eq(c.train.load_balance, MT_LB_AUX);
    cr_assert_eq(c.train.bias_update_rate, 1e-3);
    cr_assert_eq(c.data.kind, MT_DATA_SYNTHETIC);
    cr_assert_eq(c.data.synthetic_branching, 4);
    cr_assert_eq(c.data.synthetic_seed, 42);
    cr_assert_str_eq(c.checkpoint.dir, "");
    cr_assert_str_eq(c.checkpoint.export_hf, "");
    cr_assert_eq(c.checkpoint.interval, 0);
    cr_assert_eq(c.checkpoint.keep, 2);
    cr_assert_eq(c.log.interval, 1);
    cr_assert_str_eq(c.log.metrics, "");
    cr_assert(config_validate(&c, errbuf, sizeof errbuf), "%s", errbuf);
}

/* No file at all is the defaults (tests, tools); a file that sets nothing is a mistake (a truncated
 * copy, the wrong path to a template) and an error rather than a silent run of the tiny defaults. */
Test(config, no_file_gives_the_defaults_and_an_empty_file_is_an_error)
{
    struct config d, a, b;
    config_defaults(&d);
    cr_assert(load(&a, NULL, 0, NULL), "%s", errbuf);
    char *yd = body_of(&d), *ya = body_of(&a);
    cr_assert_str_eq(ya, yd);
    free(yd), free(ya);
    const char *empties[] = {"", "# nothing here\n", "train:\nlog: ~\n", "---\n...\n"};
    for (size_t i = 0; i < sizeof empties / sizeof empties[0]; i++) {
        cr_assert(!load(&b, put("empty.yaml", empties[i]), 0, NULL), "'%s' loaded", empties[i]);
        cr_assert(strstr(errbuf, "empty.yaml") && strstr(errbuf, "sets no key"), "%s", errbuf);
        cr_assert_null(strchr(errbuf, '\n'), "%s", errbuf);
    }
    /* one key is enough */
    cr_assert(load(&b, put("one.yaml", "train:\n  steps: 7\n"), 0, NULL), "%s", errbuf);
    cr_assert_eq(b.train.steps, 7);
}

Test(config, seq_len_and_guard_keys_are_checked)
{
    struct config c;
    struct { const char *set, *what; } bad[] = {
        {"train.seq_len=1", "must be >= 2"},
        {"train.seq_len=1000000", "32-bit indexing"},
        {"train.spike_factor=0.5", "spike_factor"},
        {"train.max_skipped_steps=0", "max_skipped_steps"},
        {"train.nonfinite=ignore", "nonfinite"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *sets[2] = {(char *)bad[i].set, (char *)"train.micro_batch_size=4096"};
        int n = strstr(bad[i].set, "1000000") ? 2 : 1;
        if (n == 2) sets[1] = (char *)"train.global_batch_size=4096";
        char *all[3] = {sets[0], sets[1], (char *)"train.micro_batch_size=4096"};
        cr_assert(!load(&c, "configs/tiny.yaml", n == 2 ? 3 : 1, all), "--set %s loaded", bad[i].set);
        cr_assert(strstr(errbuf, bad[i].what), "--set %s: %s", bad[i].set, errbuf);
        cr_assert_null(strchr(errbuf, '\n'), "%s", errbuf);
    }
    char *ok[] = {(char *)"train.seq_len=2", (char *)"train.nonfinite=stop", (char *)"train.spike_factor=3",
                  (char *)"train.max_skipped_steps=1"};
    cr_assert(load(&c, "configs/tiny.yaml", 4, ok), "%s", errbuf);
    cr_assert_eq(c.train.nonfinite, MT_NONFINITE_STOP);
    cr_assert_eq(c.train.spike_factor, 3);
}

/* ---- shipped configs ------------------------------------------------------------------------ */

Test(config, tiny_yaml_loads)
{
    struct config c;
    cr_assert(load(&c, "configs/tiny.yaml", 0, NULL), "%s", errbuf);
    cr_assert_str_eq(c.path, "configs/tiny.yaml");
    cr_assert_eq(c.model.hidden_size, 64);
    cr_assert_eq(c.model.num_experts, 8);
    cr_assert_eq(c.model.num_experts_per_tok, 2);
    cr_assert_eq(config_head_dim(&c.model), 16);
    cr_assert_eq(c.data.kind, MT_DATA_SYNTHETIC);
    cr_assert_gt(c.train.steps, 0);
}

/* Expected values: spec/qwen3-moe.md section 1 (Qwen/Qwen3-30B-A3B/config.json). */
Test(config, qwen3_30b_a3b_yaml_has_the_real_shapes)
{
    struct config c;
    cr_assert(load(&c, "configs/qwen3-30b-a3b.yaml", 0, NULL), "%s", errbuf);
    const struct model_config *m = &c.model;
    cr_assert_eq(m->vocab_size, 151936);
    cr_assert_eq(m->hidden_size, 2048);
    cr_assert_eq(m->intermediate_size, 6144);
    cr_assert_eq(m->moe_intermediate_size, 768);
    cr_assert_eq(m->num_hidden_layers, 48);
    cr_assert_eq(m->num_attention_heads, 32);
    cr_assert_eq(m->num_key_value_heads, 4);
    cr_assert_eq(config_head_dim(m), 128);
    cr_assert_eq(m->num_experts, 128);
    cr_assert_eq(m->num_experts_per_tok, 8);
    cr_assert(m->norm_topk_prob);
    cr_assert_eq(m->rope_theta, 1e6);
    cr_assert_eq(m->rms_norm_eps, 1e-6);
    cr_assert_eq(m->router_aux_loss_coef, 0.001);
    cr_assert_not(m->tie_word_embeddings);
    for (int l = 0; l < 48; l++) cr_assert(config_layer_is_moe(m, l), "layer %d", l);
    cr_assert_eq(c.parallel.expert_parallel_size, 8);
    cr_assert_eq(c.train.seq_len, 4096);
    cr_assert_eq(c.train.global_batch_size, 512);
    cr_assert_eq(c.train.micro_batch_size, 1);
}

/* ---- YAML value forms ----------------------------------------------------------------------- */

Test(config, rope_theta_accepts_every_number_form)
{
    const char *forms[] = { "1e6", "1000000.0", "1000000", "1.0e+6", "\"1e6\"" };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        char text[128];
        snprintf(text, sizeof text, "model:\n  rope_theta: %s\n", forms[i]);
        struct config c;
        cr_assert(load(&c, put("rope.yaml", text), 0, NULL), "%s: %s", forms[i], errbuf);
        cr_assert_eq(c.model.rope_theta, 1000000.0, "%s", forms[i]);
    }
}

Test(config, bool_spellings)
{
    const char *t[] = { "true", "yes", "on", "True", "YES" }, *f[] = { "false", "no", "off", "False" };
    for (size_t i = 0; i < 5; i++) {
        char text[128];
        snprintf(text, sizeof text, "train:\n  activation_checkpointing: %s\n", t[i]);
        struct config c;
        cr_assert(load(&c, put("b.yaml", text), 0, NULL), "%s", errbuf);
        cr_assert(c.train.activation_checkpointing, "%s", t[i]);
    }
    for (size_t i = 0; i < 4; i++) {
        char text[128];
        snprintf(text, sizeof text, "model:\n  router_fp32: %s\n", f[i]);
        struct config c;
        cr_assert(load(&c, put("b.yaml", text), 0, NULL), "%s", errbuf);
        cr_assert_not(c.model.router_fp32, "%s", f[i]);
    }
}

/* A boolean-or-auto key (parallel.reshard_after_forward): auto by default, every boolean spelling,
 * and anything else refused with a message that says what it takes. */
Test(config, tri_state_boolean_or_auto)
{
    struct config c;
    cr_assert(load(&c, put("b.yaml", "train:\n  steps: 3\n"), 0, NULL), "%s", errbuf);
    cr_assert_eq(c.parallel.reshard_after_forward, MT_TRI_AUTO);
    const char *v[] = { "auto", "AUTO", "true", "yes", "on", "false", "no", "off" };
    const enum mt_tri want[] = { MT_TRI_AUTO, MT_TRI_AUTO, MT_TRI_TRUE, MT_TRI_TRUE, MT_TRI_TRUE,
                                 MT_TRI_FALSE, MT_TRI_FALSE, MT_TRI_FALSE };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        char text[128];
        snprintf(text, sizeof text, "parallel:\n  reshard_after_forward: %s\n", v[i]);
        cr_assert(load(&c, put("b.yaml", text), 0, NULL), "%s: %s", v[i], errbuf);
        cr_assert_eq(c.parallel.reshard_after_forward, want[i], "%s", v[i]);
    }
    cr_assert_not(load(&c, put("b.yaml", "parallel:\n  reshard_after_forward: sometimes\n"), 0, NULL));
    cr_assert(strstr(errbuf, "reshard_after_forward expects a boolean (true/false/yes/no/on/off) or auto, got 'sometimes'"),
              "%s", errbuf);
}

Test(config, lists_enums_strings_and_aliases_from_yaml)
{
    struct config c;
    const char *text = "model:\n"
                       "  num_hidden_layers: 4\n"
                       "  mlp_only_layers: [0, 2]\n"
                       "  precision: fp32\n"
                       "  num_local_experts: 16\n"
                       "  init_from: 'dir with: colon'\n"
                       "parallel:\n  backend: cpu\n"
                       "train:\n  load_balance: bias\n  seed: 18446744073709551615\n"
                       "data:\n  kind: tokens\n  path: /data/x.bin\n"
                       "checkpoint:\n  dir: ~\n";
    cr_assert(load(&c, put("v.yaml", text), 0, NULL), "%s", errbuf);
    cr_assert_eq(c.model.n_mlp_only_layers, 2);
    cr_assert_eq(c.model.mlp_only_layers[0], 0);
    cr_assert_eq(c.model.mlp_only_layers[1], 2);
    cr_assert_eq(c.model.precision, MT_PREC_FP32);
    cr_assert_eq(c.model.num_experts, 16);
    cr_assert_str_eq(c.model.init_from, "dir with: colon");
    cr_assert_eq(c.parallel.backend, MT_BACKEND_CPU);
    cr_assert_eq(c.train.load_balance, MT_LB_BIAS);
    cr_assert_eq(c.train.seed, UINT64_MAX);
    cr_assert_eq(c.data.kind, MT_DATA_TOKENS);
    cr_assert_str_eq(c.data.path, "/data/x.bin");
    cr_assert_str_eq(c.checkpoint.dir, "");

    /* block-style sequence and the empty list */
    cr_assert(load(&c, put("l.yaml", "model:\n  num_hidden_layers: 3\n  mlp_only_layers:\n"
                                     "    - 1\n    - 2\n"), 0, NULL), "%s", errbuf);
    cr_assert_eq(c.model.n_mlp_only_layers, 2);
    cr_assert_eq(c.model.mlp_only_layers[1], 2);
    cr_assert(load(&c, put("l.yaml", "model:\n  mlp_only_layers: []\n"), 0, NULL), "%s", errbuf);
    cr_assert_eq(c.model.n_mlp_only_layers, 0);
}

/* ---- errors with positions ------------------------------------------------------------------ */

Test(config, malformed_yaml_names_position)
{
    /* a tab cannot start a token; it is the first character of line 2 */
    const char *m = fails("train:\n\tsteps: 1\n");
    expect_at(m, 2, 1);
    expect(m, "malformed YAML");
    /* an unclosed flow sequence: libyaml reports where it expected ',' or ']' (the end of input,
     * line 3 column 1) and where the sequence started (line 2, column 10) */
    m = fails("train:\n  steps: [1, 2\n");
    expect(m, "malformed YAML");
    expect(m, "line 2, column 10");
}

Test(config, missing_file_is_one_line)
{
    struct config c;
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/none.yaml", tmpdir);
    cr_assert_not(load(&c, path, 0, NULL));
    expect(errbuf, path);
    expect(errbuf, "cannot open config");
    cr_assert_null(strchr(errbuf, '\n'));
    cr_assert_not(load(&c, tmpdir, 0, NULL)); /* a directory */
    expect(errbuf, tmpdir);
}

Test(config, unknown_section_suggests)
{
    /* 'trian' is the first token of line 1 */
    const char *m = fails("model:\n  hidden_size: 64\ntrian:\n  steps: 5\n");
    expect_at(m, 3, 1);
    expect(m, "unknown section 'trian' (did you mean 'train'?)");
    m = fails("optimizer:\n  lr: 1\n");
    expect(m, "unknown section 'optimizer'");
    expect(m, "sections: model, parallel, train, data, checkpoint, log");
}

Test(config, unknown_key_suggests_nearest)
{
    /* "  stpes: 10": the key starts after two blanks, column 3 */
    const char *m = fails("train:\n  stpes: 10\n");
    expect_at(m, 2, 3);
    expect(m, "unknown key 'stpes' in section 'train' (did you mean 'steps'?)");
    m = fails("train:\n  lr: 0.1\n  golbal_batch_size: 4\n");
    expect_at(m, 3, 3);
    expect(m, "(did you mean 'global_batch_size'?)");
    /* a key of another section is pointed to there */
    m = fails("model:\n  lr: 0.1\n");
    expect(m, "unknown key 'lr' in section 'model' (did you mean 'train.lr'?)");
    /* nothing close: no suggestion */
    m = fails("log:\n  colour: red\n");
    expect(m, "unknown key 'colour' in section 'log'");
    cr_assert_null(strstr(m, "did you mean"), "%s", m);
}

Test(config, edit_distance)
{
    cr_assert_eq(cfg_edit_distance("stpes", "steps"), 1);  /* one swap of neighbours */
    cr_assert_eq(cfg_edit_distance("kitten", "sitting"), 3); /* k->s, e->i, +g */
    cr_assert_eq(cfg_edit_distance("", "abc"), 3);
    cr_assert_eq(cfg_edit_distance("lr", "lr"), 0);
}

Test(config, wrong_type_names_key_and_value)
{
    /* "  steps: ten": 's' at column 3, "steps:" ends at 8, the value at column 10 */
    const char *m = fails("model:\n  hidden_size: 64\ntrain:\n  steps: ten\n");
    expect_at(m, 4, 10);
    expect(m, "train.steps expects an integer, got 'ten'");
    m = fails("train:\n  steps: 10.5\n");
    expect(m, "train.steps expects an integer, got '10.5'");
    m = fails("train:\n  lr: fast\n");
    expect(m, "train.lr expects a number, got 'fast'");
    m = fails("model:\n  norm_topk_prob: maybe\n");
    expect(m, "model.norm_topk_prob expects a boolean");
    m = fails("model:\n  precision: fp16\n");
    expect(m, "model.precision expects one of bf16|fp32, got 'fp16'");
    m = fails("train:\n  load_balance: greedy\n");
    expect(m, "train.load_balance expects one of aux|bias|none");
    m = fails("data:\n  kind: files\n");
    expect(m, "data.kind expects one of synthetic|tokens");
    m = fails("parallel:\n  backend: rocm\n");
    expect(m, "parallel.backend expects one of auto|cpu|cuda");
    m = fails("train:\n  seed: -1\n");
    expect(m, "train.seed expects an unsigned 64-bit integer, got '-1'");
    /* "  steps: [1]": the sequence starts at column 10 */
    m = fails("train:\n  steps: [1]\n");
    expect_at(m, 2, 10);
    expect(m, "train.steps expects an integer, got a sequence");
    /* list element: "  mlp_only_layers: [0, x]": '[' at 20, '0' at 21, ',' 22, ' ' 23, 'x' 24 */
    m = fails("model:\n  mlp_only_layers: [0, x]\n");
    expect_at(m, 2, 24);
    expect(m, "model.mlp_only_layers expects a list of integers, got element 'x'");
    m = fails("train:\n  steps: 99999999999\n");
    expect(m, "train.steps is out of range for a 32-bit integer");
    /* a section that is not a mapping: "train: 5", the 5 at column 8 */
    m = fails("train: 5\n");
    expect_at(m, 1, 8);
    expect(m, "section 'train' must be a mapping");
}

Test(config, out_of_range)
{
    /* "  lr: -1": '-' at column 7 */
    const char *m = fails("train:\n  lr: -1\n");
    expect_at(m, 2, 7);
    expect(m, "train.lr must be > 0");
    m = fails("model:\n  hidden_size: 0\n");
    expect(m, "model.hidden_size must be >= 1 (got 0)");
    m = fails("train:\n  beta2: 1.0\n");
    expect(m, "train.beta2 must be in [0, 1)");
    m = fails("train:\n  grad_clip: -0.5\n");
    expect(m, "train.grad_clip must be >= 0");
    m = fails("model:\n  mlp_only_layers: [-1]\n");
    expect(m, "model.mlp_only_layers elements must be");
}

Test(config, top_level_must_be_a_mapping)
{
    const char *m = fails("- model\n- train\n");
    expect_at(m, 1, 1);
    expect(m, "top level must be a mapping");
    m = fails("just words\n");
    expect(m, "top level must be a mapping");
}

Test(config, duplicates_are_refused)
{
    /* the second "steps" key, line 3 column 3 */
    const char *m = fails("train:\n  steps: 1\n  steps: 2\n");
    expect_at(m, 3, 3);
    /* the first value "1" sits at line 2, column 10 */
    expect(m, "duplicate key 'steps' in section 'train' (already set at line 2, column 10)");
    m = fails("train:\n  steps: 1\nlog:\n  interval: 1\ntrain:\n  lr: 0.1\n");
    expect_at(m, 5, 1);
    expect(m, "duplicate section 'train'");
    /* one field under two names */
    m = fails("model:\n  num_experts: 8\n  num_local_experts: 8\n");
    expect_at(m, 3, 3);
    expect(m, "duplicate key 'num_local_experts'");
    m = fails("train:\n  steps: 1\n---\ntrain:\n  steps: 2\n");
    expect(m, "one YAML document");
}

Test(config, missing_required_and_cross_field_checks)
{
    /* "  kind: tokens": the value at column 9; data.path was never set */
    const char *m = fails("data:\n  kind: tokens\n");
    expect_at(m, 2, 9);
    expect(m, "data.path is required when data.kind is tokens");
    /* "  num_attention_heads: 6": 19-letter key from column 3, value at column 24 */
    m = fails("model:\n  num_attention_heads: 6\n  num_key_value_heads: 4\n");
    expect_at(m, 2, 24);
    expect(m, "model.num_attention_heads (6) must be a multiple of model.num_key_value_heads (4)");
    /* "  num_experts_per_tok: 9" against the default 8 experts: value at column 24 */
    m = fails("model:\n  num_experts_per_tok: 9\n");
    expect_at(m, 2, 24);
    expect(m, "model.num_experts_per_tok (9) must be <= model.num_experts (8)");
    /* "  min_lr: 1.0e-3": value at column 11 */
    m = fails("train:\n  lr: 1.0e-4\n  min_lr: 1.0e-3\n");
    expect_at(m, 3, 11);
    expect(m, "train.min_lr");
    expect(m, "must be <= train.lr");
    m = fails("model:\n  num_hidden_layers: 2\n  mlp_only_layers: [2]\n");
    expect(m, "model.mlp_only_layers names layer 2 but there are only 2 layers");
    m = fails("model:\n  head_dim: 15\n");
    expect(m, "model.head_dim (15) must be even");
    m = fails("model:\n  head_dim: 0\n  hidden_size: 12\n  num_attention_heads: 4\n"
              "  num_key_value_heads: 2\n");
    expect(m, "hidden_size / num_attention_heads = 12 / 4 = 3");
    m = fails("train:\n  global_batch_size: 2\n  micro_batch_size: 4\n");
    expect(m, "train.micro_batch_size (4) must be <= train.global_batch_size (2)");
    m = fails("model:\n  num_experts: 8\n  n_group: 3\n");
    expect(m, "model.n_group (3) must divide model.num_experts (8)");
    m = fails("model:\n  num_experts: 8\n  n_group: 4\n  topk_group: 5\n");
    expect(m, "model.topk_group (5) must be <= model.n_group (4)");
    m = fails("model:\n  num_experts: 8\n  num_experts_per_tok: 3\n  n_group: 4\n  topk_group: 1\n");
    expect(m, "model.num_experts_per_tok (3) must be <= the experts of model.topk_group (1) groups of 2");
    m = fails("model:\n  route_scale: 0\n");
    expect(m, "route_scale");
    m = fails("model:\n  scoring: tanh\n");
    expect(m, "scoring");
    m = fails("train:\n  aux_loss_scope: step\n");
    expect(m, "aux_loss_scope");
    m = fails("train:\n  no_decay_modules: [gate, bias]\n");
    expect(m, "train.no_decay_modules: unknown module 'bias' (known: gate, norm, embed");
    m = fails("train:\n  no_decay_modules: [gate, gate]\n");
    expect(m, "repeated module 'gate'");
    m = fails("train:\n  no_decay_modules: [gate, [norm]]\n");
    expect(m, "train.no_decay_modules expects a list of module names");
    m = fails("model:\n  router_weight_decay: true\ntrain:\n  no_decay_modules: [norm]\n");
    expect(m, "set it or model.router_weight_decay, not both");
    m = fails("model:\n  vocab_size: 3\n");
    expect(m, "data.synthetic_branching (4) must be <= model.vocab_size (3)");
}

/* train_router and freeze_router are two behaviours (docs/router.md): setting one leaves the other */
Test(config, router_switches_are_independent)
{
    struct config c;
    cr_assert(load(&c, put("r.yaml", "model:\n  train_router: false\n"), 0, NULL), "%s", errbuf);
    cr_assert(!c.model.freeze_router && !c.model.train_router);
    cr_assert(load(&c, put("r.yaml", "model:\n  freeze_router: true\n"), 0, NULL), "%s", errbuf);
    cr_assert(c.model.freeze_router && c.model.train_router);
    cr_assert(load(&c, put("r.yaml", "model:\n  freeze_router: true\n  train_router: true\n"), 0, NULL),
              "%s", errbuf);
}

Test(config, no_decay_modules_load_as_a_yaml_list_or_text)
{
    struct config c;
    cr_assert(load(&c, put("n.yaml", "train:\n  no_decay_modules: [gate, norm, embed]\n"), 0, NULL),
              "%s", errbuf);
    cr_assert_str_eq(c.train.no_decay_modules, "[gate, norm, embed]");
    cr_assert(load(&c, put("n.yaml", "train:\n  no_decay_modules:\n    - lm_head\n    - attn\n"), 0, NULL),
              "%s", errbuf);
    cr_assert_str_eq(c.train.no_decay_modules, "[lm_head, attn]");
    char *sets[] = {"train.no_decay_modules=experts,mlp"};
    cr_assert(load(&c, put("n.yaml", "train:\n  steps: 2\n"), 1, sets), "%s", errbuf);
    cr_assert_str_eq(c.train.no_decay_modules, "experts,mlp");
}

/* ---- --set ---------------------------------------------------------------------------------- */

Test(config, set_overrides_every_type)
{
    const char *p = put("s.yaml", "model:\n  num_hidden_layers: 3\ntrain:\n  steps: 10\n");
    char *sets[] = {
        "train.steps=20",                      /* int, over the file's 10 */
        "train.seed=18446744073709551614",     /* uint64 */
        "model.rope_theta=1e7",                /* double */
        "train.activation_checkpointing=on",   /* bool */
        "checkpoint.dir=/tmp/run: 1 #a",       /* string, kept verbatim */
        "model.precision=fp32",                /* enum */
        "model.mlp_only_layers=[0, 2]",        /* int list */
        "train.steps=30",                      /* a later --set wins */
        "log.metrics=",                        /* empty string */
        "model.num_local_experts=4",           /* alias */
    };
    struct config c;
    cr_assert(load(&c, p, (int)(sizeof sets / sizeof sets[0]), sets), "%s", errbuf);
    cr_assert_eq(c.train.steps, 30);
    cr_assert_eq(c.train.seed, UINT64_MAX - 1);
    cr_assert_eq(c.model.rope_theta, 1e7);
    cr_assert(c.train.activation_checkpointing);
    cr_assert_str_eq(c.checkpoint.dir, "/tmp/run: 1 #a");
    cr_assert_eq(c.model.precision, MT_PREC_FP32);
    cr_assert_eq(c.model.n_mlp_only_layers, 2);
    cr_assert_eq(c.model.mlp_only_layers[1], 2);
    cr_assert_str_eq(c.log.metrics, "");
    cr_assert_eq(c.model.num_experts, 4);
    cr_assert_eq(c.model.num_hidden_layers, 3);  /* from the file, untouched */

    char *more[] = { "model.mlp_only_layers=1,2", "model.mlp_only_layers=[]" };
    cr_assert(load(&c, p, 1, more), "%s", errbuf);
    cr_assert_eq(c.model.n_mlp_only_layers, 2);
    cr_assert(load(&c, p, 2, more), "%s", errbuf);
    cr_assert_eq(c.model.n_mlp_only_layers, 0);
    /* no file at all: defaults + --set */
    char *one[] = { "train.lr=0.5" };
    cr_assert(load(&c, NULL, 1, one), "%s", errbuf);
    cr_assert_eq(c.train.lr, 0.5);
}

static const char *set_fails(const char *s)
{
    struct config c;
    char *sets[] = { (char *)s };
    cr_assert_not(load(&c, NULL, 1, sets), "--set %s loaded", s);
    cr_assert_null(strchr(errbuf, '\n'));
    return errbuf;
}

Test(config, set_errors_name_the_override)
{
    const char *m = set_fails("train.steps=ten");
    expect(m, "--set train.steps: train.steps expects an integer, got 'ten'");
    m = set_fails("train.stpes=10");
    expect(m, "--set train.stpes: unknown key 'stpes' in section 'train' (did you mean 'steps'?)");
    m = set_fails("trian.steps=10");
    expect(m, "unknown section 'trian' (did you mean 'train'?)");
    m = set_fails("steps=10");
    expect(m, "--set 'steps=10': expected section.key=value");
    m = set_fails("train.steps");
    expect(m, "expected section.key=value");
    m = set_fails("train.lr=0");
    expect(m, "--set train.lr: train.lr must be > 0");
    m = set_fails("model.precision=int8");
    expect(m, "--set model.precision: model.precision expects one of bf16|fp32");
    m = set_fails("model.norm_topk_prob=2");
    expect(m, "--set model.norm_topk_prob: model.norm_topk_prob expects a boolean");
    m = set_fails("model.mlp_only_layers=[0,,1]");
    expect(m, "--set model.mlp_only_layers:");
    m = set_fails("model.mlp_only_layers=[0");
    expect(m, "expects a list like [1, 2]");
    m = set_fails("train.steps=");
    expect(m, "train.steps expects an integer, got ''");
    /* a cross-field problem caused by --set names it */
    m = set_fails("data.kind=tokens");
    expect(m, "--set data.kind: data.path is required when data.kind is tokens");
}

/* ---- layers --------------------------------------------------------------------------------- */

Test(config, layer_is_moe_and_head_dim)
{
    struct config c;
    config_defaults(&c);
    struct model_config *m = &c.model;
    m->num_hidden_layers = 6;
    m->decoder_sparse_step = 2;
    m->n_mlp_only_layers = 1;
    m->mlp_only_layers[0] = 3;
    /* (i+1) % 2 == 0 picks layers 1, 3, 5; layer 3 is listed as dense */
    bool want[6] = { false, true, false, false, false, true };
    for (int i = 0; i < 6; i++) cr_assert_eq(config_layer_is_moe(m, i), want[i], "layer %d", i);
    m->num_experts = 0;
    for (int i = 0; i < 6; i++) cr_assert_not(config_layer_is_moe(m, i));
    m->head_dim = 0;
    m->hidden_size = 96;
    m->num_attention_heads = 4;
    cr_assert_eq(config_head_dim(m), 24);
    m->head_dim = 32;
    cr_assert_eq(config_head_dim(m), 32);
}

/* parallel.moe_fixed_exchange: auto resolves from EP, top-k, chunks and pipeline; true and false
 * are taken as set */
Test(config, moe_fixed_exchange_auto_follows_the_padding_and_the_paths)
{
    struct config c;
    config_defaults(&c);
    const struct { int ep, k, chunks, pp; bool on; } cases[] = {
        {1, 8, 1, 1, false}, /* no exchange */
        {2, 8, 1, 1, true},  {4, 8, 1, 1, true}, {6, 8, 1, 1, true},
        {8, 8, 1, 1, false}, /* blocks 66% full at top-8 */
        {2, 2, 1, 1, true},  {4, 2, 1, 1, false},
        {2, 8, 2, 1, false}, /* the chunked exchange counts */
        {2, 8, 1, 2, false}, /* a pipelined step is not run again */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        c.parallel.expert_parallel_size = cases[i].ep;
        c.model.num_experts_per_tok = cases[i].k;
        c.parallel.moe_chunks = cases[i].chunks;
        c.parallel.pipeline_parallel_size = cases[i].pp;
        c.parallel.moe_fixed_exchange = MT_TRI_AUTO;
        cr_expect_eq(config_moe_fixed_exchange(&c), cases[i].on, "ep %d top-%d chunks %d pp %d", cases[i].ep,
                     cases[i].k, cases[i].chunks, cases[i].pp);
        c.parallel.moe_fixed_exchange = MT_TRI_TRUE;
        cr_expect(config_moe_fixed_exchange(&c));
        c.parallel.moe_fixed_exchange = MT_TRI_FALSE;
        cr_expect(!config_moe_fixed_exchange(&c));
    }
}
