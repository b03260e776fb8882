/* The table of config keys (new keys are added here, and documented in docs/config.md) and the
 * lookups by name: exact, and the nearest one for "did you mean" hints. Parsing and formatting the
 * values of these keys is config_value.c. */
#include "config_table.h"

#include <stdio.h>
#include <string.h>

/* Enum fields are stored through int pointers. */
_Static_assert(sizeof(enum mt_precision) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_load_balance) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_data_kind) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_backend_choice) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_weight_copy) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_reduce_grads) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_tri) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_state_dtype) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_scoring) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_aux_scope) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_nonfinite) == sizeof(int), "enum size");

static const char *const precision_names[] = { "bf16", "fp32" };
static const char *const load_balance_names[] = { "aux", "bias", "none" };
static const char *const data_kind_names[] = { "synthetic", "tokens" };
static const char *const backend_names[] = { "auto", "cpu", "cuda" };
static const char *const weight_copy_names[] = { "auto", "keep", "cast" };
static const char *const reduce_grads_names[] = { "micro_step", "step", "auto" };
static const char *const state_dtype_names[] = { "fp32", "bf16" };
static const char *const master_weights_names[] = { "fp32", "split", "auto" };
static const char *const scoring_names[] = { "softmax", "sigmoid" };
static const char *const aux_scope_names[] = { "micro_batch", "global_batch" };
static const char *const nonfinite_names[] = { "skip", "stop" };

#define FIELD(f) offsetof(struct config, f), sizeof(((struct config *)0)->f)
/* the bounds argument is one of POS / NONNEG / GT0 below, or "flags, lo, hi" */
#define INT(sec, name, f, ...) { sec, name, CFG_INT, FIELD(f), 0, __VA_ARGS__, NULL, 0, false }
#define DBL(sec, name, f, ...) { sec, name, CFG_DOUBLE, FIELD(f), 0, __VA_ARGS__, NULL, 0, false }
#define U64(sec, name, f) { sec, name, CFG_U64, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define BOOL(sec, name, f) { sec, name, CFG_BOOL, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define TRI(sec, name, f) { sec, name, CFG_TRI, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define STR(sec, name, f) { sec, name, CFG_STRING, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define ENUM(sec, name, f, names) \
    { sec, name, CFG_ENUM, FIELD(f), 0, 0, 0, 0, names, (int)(sizeof names / sizeof names[0]), false }

#define POS CFG_LO, 1, 0                  /* >= 1 */
#define NONNEG CFG_LO, 0, 0               /* >= 0 */
#define GT0 CFG_LO | CFG_LO_OPEN, 0, 0    /* > 0 */

/* Order = the order config_to_yaml prints. Key names are part of the user interface: never rename. */
const struct cfg_key cfg_keys[] = {
    STR("model", "hf_config", model.hf_config),
    STR("model", "init_from", model.init_from),
    INT("model", "vocab_size", model.vocab_size, POS),
    INT("model", "hidden_size", model.hidden_size, POS),
    INT("model", "intermediate_size", model.intermediate_size, POS),
    INT("model", "moe_intermediate_size", model.moe_intermediate_size, POS),
    INT("model", "num_hidden_layers", model.num_hidden_layers, CFG_LO | CFG_HI, 1, MT_MAX_LAYERS),
    INT("model", "num_attention_heads", model.num_attention_heads, POS),
    INT("model", "num_key_value_heads", model.num_key_value_heads, POS),
    INT("model", "head_dim", model.head_dim, NONNEG),
    INT("model", "num_experts", model.num_experts, NONNEG),
    INT("model", "num_experts_per_tok", model.num_experts_per_tok, POS),
    INT("model", "decoder_sparse_step", model.decoder_sparse_step, POS),
    { "model", "mlp_only_layers", CFG_INT_LIST, FIELD(model.mlp_only_layers),
      offsetof(struct config, model.n_mlp_only_layers), CFG_LO | CFG_HI, 0, MT_MAX_LAYERS - 1,
      NULL, 0, false },
    BOOL("model", "norm_topk_prob", model.norm_topk_prob),
    BOOL("model", "tie_word_embeddings", model.tie_word_embeddings),
    DBL("model", "rope_theta", model.rope_theta, GT0),
    DBL("model", "rms_norm_eps", model.rms_norm_eps, GT0),
    DBL("model", "router_aux_loss_coef", model.router_aux_loss_coef, NONNEG),
    DBL("model", "initializer_range", model.initializer_range, NONNEG),
    INT("model", "max_position_embeddings", model.max_position_embeddings, POS),
    ENUM("model", "precision", model.precision, precision_names),
    BOOL("model", "router_fp32", model.router_fp32),
    BOOL("model", "freeze_router", model.freeze_router),
    BOOL("model", "train_router", model.train_router),
    BOOL("model", "router_weight_decay", model.router_weight_decay),
    ENUM("model", "scoring", model.scoring, scoring_names),
    DBL("model", "route_scale", model.route_scale, GT0),
    INT("model", "n_group", model.n_group, POS),
    INT("model", "topk_group", model.topk_group, NONNEG),
    BOOL("model", "debug_force_balance", model.debug_force_balance),

    INT("parallel", "pipeline_parallel_size", parallel.pipeline_parallel_size, POS),
    INT("parallel", "expert_parallel_size", parallel.expert_parallel_size, POS),
    BOOL("parallel", "ep_outside", parallel.ep_outside),
    { "parallel", "pipeline_layers", CFG_INT_LIST, FIELD(parallel.pipeline_layers),
      offsetof(struct config, parallel.n_pipeline_layers), CFG_LO | CFG_HI, 1, MT_MAX_LAYERS,
      NULL, 0, false },
    ENUM("parallel", "backend", parallel.backend, backend_names),
    TRI("parallel", "reshard_after_forward", parallel.reshard_after_forward),
    BOOL("parallel", "prefetch", parallel.prefetch),
    ENUM("parallel", "reduce_grads", parallel.reduce_grads, reduce_grads_names),
    INT("parallel", "moe_chunks", parallel.moe_chunks, POS),
    TRI("parallel", "moe_fixed_exchange", parallel.moe_fixed_exchange),
    TRI("parallel", "expert_wgrad_pairs", parallel.expert_wgrad_pairs),
    INT("parallel", "expert_wgrad_group", parallel.expert_wgrad_group, CFG_LO | CFG_HI, 0, 8), /* ops.h MT_WGRAD_MAX_SETS */
    BOOL("parallel", "expert_wgrad_jobs", parallel.expert_wgrad_jobs),
    BOOL("parallel", "moe_combine_self_last", parallel.moe_combine_self_last),

    INT("train", "steps", train.steps, POS),
    INT("train", "seq_len", train.seq_len, POS),
    INT("train", "global_batch_size", train.global_batch_size, POS),
    INT("train", "micro_batch_size", train.micro_batch_size, POS),
    DBL("train", "lr", train.lr, GT0),
    DBL("train", "min_lr", train.min_lr, NONNEG),
    INT("train", "warmup_steps", train.warmup_steps, NONNEG),
    DBL("train", "weight_decay", train.weight_decay, NONNEG),
    DBL("train", "beta1", train.beta1, CFG_LO | CFG_HI | CFG_HI_OPEN, 0, 1),
    DBL("train", "beta2", train.beta2, CFG_LO | CFG_HI | CFG_HI_OPEN, 0, 1),
    DBL("train", "adam_eps", train.adam_eps, GT0),
    DBL("train", "grad_clip", train.grad_clip, NONNEG),
    U64("train", "seed", train.seed),
    BOOL("train", "activation_checkpointing", train.activation_checkpointing),
    ENUM("train", "load_balance", train.load_balance, load_balance_names),
    DBL("train", "bias_update_rate", train.bias_update_rate, NONNEG),
    ENUM("train", "weight_copy", train.weight_copy, weight_copy_names),
    ENUM("train", "optimizer_state_dtype", train.optimizer_state_dtype, state_dtype_names),
    ENUM("train", "master_weights", train.master_weights, master_weights_names),
    INT("train", "watchdog_s", train.watchdog_s, NONNEG),
    STR("train", "no_decay_modules", train.no_decay_modules),
    ENUM("train", "aux_loss_scope", train.aux_loss_scope, aux_scope_names),
    ENUM("train", "nonfinite", train.nonfinite, nonfinite_names),
    INT("train", "max_skipped_steps", train.max_skipped_steps, POS),
    DBL("train", "spike_factor", train.spike_factor, NONNEG),

    ENUM("data", "kind", data.kind, data_kind_names),
    STR("data", "path", data.path),
    STR("data", "sources", data.sources),
    BOOL("data", "shuffle", data.shuffle),
    U64("data", "seed", data.seed),
    INT("data", "eos_id", data.eos_id, CFG_LO | CFG_HI, -1, INT_MAXD),
    BOOL("data", "document_masking", data.document_masking),
    BOOL("data", "loss_after_eos", data.loss_after_eos),
    STR("data", "validation_path", data.validation_path),
    INT("data", "validation_interval", data.validation_interval, POS),
    INT("data", "validation_batches", data.validation_batches, POS),
    INT("data", "synthetic_branching", data.synthetic_branching, POS),
    U64("data", "synthetic_seed", data.synthetic_seed),
    STR("data", "routing_replay", data.routing_replay),

    STR("checkpoint", "dir", checkpoint.dir),
    INT("checkpoint", "interval", checkpoint.interval, NONNEG),
    INT("checkpoint", "keep", checkpoint.keep, NONNEG),
    STR("checkpoint", "export_hf", checkpoint.export_hf),
    ENUM("checkpoint", "export_dtype", checkpoint.export_dtype, precision_names),
    U64("checkpoint", "export_shard_bytes", checkpoint.export_shard_bytes),

    INT("log", "interval", log.interval, POS),
    STR("log", "metrics", log.metrics),
    BOOL("log", "profile", log.profile),
    INT("log", "collapse_steps", log.collapse_steps, NONNEG),
    DBL("log", "load_warn", log.load_warn, NONNEG),

    /* transformers 5.x's name for num_experts, so model sections copied from a 5.x config.json load */
    { "model", "num_local_experts", CFG_INT, FIELD(model.num_experts), 0, NONNEG, NULL, 0, true },
};
const int cfg_n_keys = (int)(sizeof cfg_keys / sizeof cfg_keys[0]);

const char *const cfg_sections[] = { "model", "parallel", "train", "data", "checkpoint", "log" };
const int cfg_n_sections = (int)(sizeof cfg_sections / sizeof cfg_sections[0]);

int cfg_find(const char *section, const char *key)
{
    for (int i = 0; i < cfg_n_keys; i++) {
        if (strcmp(cfg_keys[i].section, section) != 0 || strcmp(cfg_keys[i].key, key) != 0)
            continue;
        if (!cfg_keys[i].alias) return i;
        for (int j = 0; j < cfg_n_keys; j++)  /* the canonical row is the one at the same place */
            if (!cfg_keys[j].alias && cfg_keys[j].offset == cfg_keys[i].offset) return j;
    }
    return -1;
}

bool cfg_section_known(const char *section)
{
    for (int i = 0; i < cfg_n_sections; i++)
        if (strcmp(cfg_sections[i], section) == 0) return true;
    return false;
}

int cfg_edit_distance(const char *a, const char *b)
{
    int n = (int)strlen(a), m = (int)strlen(b);
    if (n > 64 || m > 64) return 1000;  /* no key is that long; not worth suggesting */
    int d[65][65];
    for (int i = 0; i <= n; i++) d[i][0] = i;
    for (int j = 0; j <= m; j++) d[0][j] = j;
    for (int i = 1; i <= n; i++) {
        for (int j = 1; j <= m; j++) {
            int cost = a[i - 1] != b[j - 1];
            int v = MT_MIN(d[i - 1][j] + 1, d[i][j - 1] + 1);
            v = MT_MIN(v, d[i - 1][j - 1] + cost);
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
                v = MT_MIN(v, d[i - 2][j - 2] + 1);
            d[i][j] = v;
        }
    }
    return d[n][m];
}

/* Close enough to be the key the user meant: short names allow 2 edits, long ones a third. */
static bool near(const char *typed, int dist)
{
    int len = (int)strlen(typed);
    return dist <= MT_MAX(2, MT_MIN(3, len / 3));
}

void cfg_suggest_key(const char *section, const char *key, char *buf, size_t cap)
{
    int best = -1, best_d = 1 << 30;
    for (int i = 0; i < cfg_n_keys; i++) {
        if (strcmp(cfg_keys[i].section, section) != 0) continue;
        int d = cfg_edit_distance(key, cfg_keys[i].key);
        if (d < best_d) { best_d = d; best = i; }
    }
    if (best >= 0 && near(key, best_d)) {
        snprintf(buf, cap, " (did you mean '%s'?)", cfg_keys[best].key);
        return;
    }
    for (int i = 0; i < cfg_n_keys; i++) {
        if (strcmp(cfg_keys[i].key, key) == 0) {
            snprintf(buf, cap, " (did you mean '%s.%s'?)", cfg_keys[i].section, key);
            return;
        }
    }
    if (cap) buf[0] = 0;
}

void cfg_suggest_section(const char *section, char *buf, size_t cap)
{
    int best = -1, best_d = 1 << 30;
    for (int i = 0; i < cfg_n_sections; i++) {
        int d = cfg_edit_distance(section, cfg_sections[i]);
        if (d < best_d) { best_d = d; best = i; }
    }
    if (best >= 0 && near(section, best_d))
        snprintf(buf, cap, " (did you mean '%s'?)", cfg_sections[best]);
    else
        snprintf(buf, cap, " (sections: model, parallel, train, data, checkpoint, log)");
}

const char *cfg_type_desc(const struct cfg_key *k, char *buf, size_t cap)
{
    switch (k->type) {
    case CFG_INT: return "an integer";
    case CFG_U64: return "an unsigned 64-bit integer";
    case CFG_DOUBLE: return "a number";
    case CFG_BOOL: return "a boolean (true/false/yes/no/on/off)";
    case CFG_TRI: return "a boolean (true/false/yes/no/on/off) or auto";
    case CFG_STRING: return "a string";
    case CFG_INT_LIST: return "a list of integers";
    case CFG_ENUM: {
        size_t used = (size_t)snprintf(buf, cap, "one of ");
        for (int i = 0; i < k->n_names && used < cap; i++)
            used += (size_t)snprintf(buf + used, cap - used, "%s%s", i ? "|" : "", k->names[i]);
        return buf;
    }
    }
    return "a value";
}
