#include "config_table.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Enum fields are stored through int pointers. */
_Static_assert(sizeof(enum mt_precision) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_load_balance) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_data_kind) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_backend_choice) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_weight_copy) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_state_dtype) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_scoring) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_aux_scope) == sizeof(int), "enum size");
_Static_assert(sizeof(enum mt_nonfinite) == sizeof(int), "enum size");

static const char *const precision_names[] = { "bf16", "fp32" };
static const char *const load_balance_names[] = { "aux", "bias", "none" };
static const char *const data_kind_names[] = { "synthetic", "tokens" };
static const char *const backend_names[] = { "auto", "cpu", "cuda" };
static const char *const weight_copy_names[] = { "auto", "keep", "cast" };
static const char *const state_dtype_names[] = { "fp32", "bf16" };
static const char *const scoring_names[] = { "softmax", "sigmoid" };
static const char *const aux_scope_names[] = { "micro_batch", "global_batch" };
static const char *const nonfinite_names[] = { "skip", "stop" };

#define FIELD(f) offsetof(struct config, f), sizeof(((struct config *)0)->f)
/* the bounds argument is one of POS / NONNEG / GT0 below, or "flags, lo, hi" */
#define INT(sec, name, f, ...) { sec, name, CFG_INT, FIELD(f), 0, __VA_ARGS__, NULL, 0, false }
#define DBL(sec, name, f, ...) { sec, name, CFG_DOUBLE, FIELD(f), 0, __VA_ARGS__, NULL, 0, false }
#define U64(sec, name, f) { sec, name, CFG_U64, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define BOOL(sec, name, f) { sec, name, CFG_BOOL, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define STR(sec, name, f) { sec, name, CFG_STRING, FIELD(f), 0, 0, 0, 0, NULL, 0, false }
#define ENUM(sec, name, f, names) \
    { sec, name, CFG_ENUM, FIELD(f), 0, 0, 0, 0, names, (int)(sizeof names / sizeof names[0]), false }

#define POS CFG_LO, 1, 0                  /* >= 1 */
#define NONNEG CFG_LO, 0, 0               /* >= 0 */
#define GT0 CFG_LO | CFG_LO_OPEN, 0, 0    /* > 0 */
#define INT_MAXD 2147483647.0

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
    BOOL("parallel", "reshard_after_forward", parallel.reshard_after_forward),
    BOOL("parallel", "prefetch", parallel.prefetch),

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

/* ---- typed scalars ---------------------------------------------------------------------- */

/* Copy of s without leading/trailing blanks (a --set value may carry them). */
static void trim(const char *s, char *out, size_t cap)
{
    while (*s && isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) n--;
    if (n >= cap) n = cap - 1;
    memcpy(out, s, n);
    out[n] = 0;
}

/* The user's text, shortened for a one-line message. */
static const char *shown(const char *text, char *buf, size_t cap)
{
    size_t n = strlen(text);
    if (n < cap) return text;
    snprintf(buf, cap, "%.*s...", (int)(cap - 4), text);
    return buf;
}

static void bounds_text(const struct cfg_key *k, char *buf, size_t cap)
{
    char lo[40], hi[40];
    snprintf(lo, sizeof lo, "%.15g", k->lo);
    snprintf(hi, sizeof hi, "%.15g", k->hi);
    bool has_lo = k->bounds & CFG_LO, has_hi = k->bounds & CFG_HI;
    if (has_lo && has_hi)
        snprintf(buf, cap, "in %s%s, %s%s", k->bounds & CFG_LO_OPEN ? "(" : "[", lo, hi,
                 k->bounds & CFG_HI_OPEN ? ")" : "]");
    else if (has_lo)
        snprintf(buf, cap, "%s %s", k->bounds & CFG_LO_OPEN ? ">" : ">=", lo);
    else
        snprintf(buf, cap, "%s %s", k->bounds & CFG_HI_OPEN ? "<" : "<=", hi);
}

static bool in_bounds(const struct cfg_key *k, double v)
{
    if (k->bounds & CFG_LO) {
        if (k->bounds & CFG_LO_OPEN ? !(v > k->lo) : !(v >= k->lo)) return false;
    }
    if (k->bounds & CFG_HI) {
        if (k->bounds & CFG_HI_OPEN ? !(v < k->hi) : !(v <= k->hi)) return false;
    }
    return true;
}

static bool bounds_error(const struct cfg_key *k, const char *what, char *msg, size_t cap)
{
    char b[96];
    bounds_text(k, b, sizeof b);
    snprintf(msg, cap, "%s.%s%s must be %s (got %s)", k->section, k->key,
             k->type == CFG_INT_LIST ? " elements" : "", b, what);
    return false;
}

static bool parse_ll(const char *t, long long *out)
{
    if (!*t) return false;
    errno = 0;
    char *end = NULL;
    long long v = strtoll(t, &end, 10);
    if (end == t || *end || errno) return false;
    *out = v;
    return true;
}

static bool parse_int(const struct cfg_key *k, const char *t, int *out, char *msg, size_t cap)
{
    long long v;
    char sb[72];
    if (!parse_ll(t, &v)) {
        /* distinguish "12345678901234567890" (too big) from "ten" (not a number) */
        bool digits = *t != 0;
        for (const char *p = (*t == '-' || *t == '+') ? t + 1 : t; *p; p++)
            if (!isdigit((unsigned char)*p)) digits = false;
        if (digits) {
            snprintf(msg, cap, "%s.%s is out of range for a 32-bit integer (got %s)", k->section,
                     k->key, shown(t, sb, sizeof sb));
            return false;
        }
        snprintf(msg, cap, "%s.%s expects an integer, got '%s'", k->section, k->key,
                 shown(t, sb, sizeof sb));
        return false;
    }
    if (v < -INT_MAXD - 1 || v > INT_MAXD) {
        snprintf(msg, cap, "%s.%s is out of range for a 32-bit integer (got %s)", k->section, k->key,
                 t);
        return false;
    }
    if (!in_bounds(k, (double)v)) return bounds_error(k, t, msg, cap);
    *out = (int)v;
    return true;
}

static bool parse_bool(const char *t, bool *out)
{
    static const char *const yes[] = { "true", "yes", "on" }, *const no[] = { "false", "no", "off" };
    for (int i = 0; i < 3; i++) {
        if (strcasecmp(t, yes[i]) == 0) { *out = true; return true; }
        if (strcasecmp(t, no[i]) == 0) { *out = false; return true; }
    }
    return false;
}

bool cfg_list_clear(const struct cfg_key *k, struct config *c)
{
    *(int *)((char *)c + k->count_offset) = 0;
    return true;
}

bool cfg_list_append(const struct cfg_key *k, struct config *c, const char *text, char *msg,
                     size_t cap)
{
    int *n = (int *)((char *)c + k->count_offset);
    int *arr = (int *)((char *)c + k->offset);
    int cap_elems = (int)(k->size / sizeof(int));
    char t[128], sb[72];
    trim(text, t, sizeof t);
    long long v;
    if (!parse_ll(t, &v)) {
        snprintf(msg, cap, "%s.%s expects a list of integers, got element '%s'", k->section, k->key,
                 shown(t, sb, sizeof sb));
        return false;
    }
    if (!in_bounds(k, (double)v)) return bounds_error(k, t, msg, cap);
    if (*n >= cap_elems) {
        snprintf(msg, cap, "%s.%s has more than %d elements", k->section, k->key, cap_elems);
        return false;
    }
    arr[(*n)++] = (int)v;
    return true;
}

/* "[1, 2]", "1,2", "3", "[]" or "" */
static bool parse_list_text(const struct cfg_key *k, struct config *c, const char *t, char *msg,
                            size_t cap)
{
    cfg_list_clear(k, c);
    size_t n = strlen(t);
    char sb[72];
    if (n > 0 && (t[0] == '[' || t[n - 1] == ']')) {
        if (n < 2 || t[0] != '[' || t[n - 1] != ']') {
            snprintf(msg, cap, "%s.%s expects a list like [1, 2], got '%s'", k->section, k->key,
                     shown(t, sb, sizeof sb));
            return false;
        }
        t++;
        n -= 2;
    }
    bool blank = true;
    for (size_t i = 0; i < n; i++)
        if (!isspace((unsigned char)t[i])) blank = false;
    if (blank) return true;  /* [] */
    /* split on every comma, so "1,,2" and "1," show up as empty elements */
    size_t start = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && t[i] != ',') continue;
        char elem[64];
        size_t len = i - start;
        if (len >= sizeof elem) {
            snprintf(msg, cap, "%s.%s has an element longer than %zu characters", k->section,
                     k->key, sizeof elem - 1);
            return false;
        }
        memcpy(elem, t + start, len);
        elem[len] = 0;
        if (!cfg_list_append(k, c, elem, msg, cap)) return false;
        start = i + 1;
    }
    return true;
}

bool cfg_parse_scalar(const struct cfg_key *k, struct config *c, const char *text, bool is_null,
                      char *msg, size_t cap)
{
    void *field = (char *)c + k->offset;
    char sb[72];
    if (k->type == CFG_STRING) {
        /* strings keep their inner blanks: they are paths */
        if (is_null) text = "";
        if (!mt_strlcpy(field, text, k->size)) {
            snprintf(msg, cap, "%s.%s is longer than %zu bytes", k->section, k->key, k->size - 1);
            return false;
        }
        return true;
    }
    if (k->type == CFG_INT_LIST && is_null) return cfg_list_clear(k, c);

    size_t tl = strlen(text) + 1;
    char *t = mt_malloc(tl);
    trim(text, t, tl);
    bool ok = true;
    switch (k->type) {
    case CFG_INT:
        ok = parse_int(k, t, field, msg, cap);
        break;
    case CFG_U64: {
        errno = 0;
        char *end = NULL;
        unsigned long long v = strtoull(t, &end, 10);
        if (!*t || *t == '-' || end == t || *end || errno) {
            snprintf(msg, cap, "%s.%s expects an unsigned 64-bit integer, got '%s'", k->section,
                     k->key, shown(t, sb, sizeof sb));
            ok = false;
        } else {
            *(uint64_t *)field = (uint64_t)v;
        }
        break;
    }
    case CFG_DOUBLE: {
        char *end = NULL;
        double v = *t ? strtod(t, &end) : 0.0;
        if (!*t || end == t || *end || !isfinite(v)) {
            snprintf(msg, cap, "%s.%s expects a number, got '%s'", k->section, k->key,
                     shown(t, sb, sizeof sb));
            ok = false;
        } else if (!in_bounds(k, v)) {
            ok = bounds_error(k, t, msg, cap);
        } else {
            *(double *)field = v;
        }
        break;
    }
    case CFG_BOOL:
        if (is_null || !parse_bool(t, field)) {
            snprintf(msg, cap, "%s.%s expects a boolean (true/false/yes/no/on/off), got '%s'",
                     k->section, k->key, shown(t, sb, sizeof sb));
            ok = false;
        }
        break;
    case CFG_ENUM: {
        int found = -1;
        for (int i = 0; i < k->n_names; i++)
            if (strcasecmp(t, k->names[i]) == 0) found = i;
        if (found < 0) {
            char opts[128];
            snprintf(msg, cap, "%s.%s expects %s, got '%s'", k->section, k->key,
                     cfg_type_desc(k, opts, sizeof opts), shown(t, sb, sizeof sb));
            ok = false;
        } else {
            *(int *)field = found;
        }
        break;
    }
    case CFG_INT_LIST:
        ok = parse_list_text(k, c, t, msg, cap);
        break;
    case CFG_STRING:
        break;
    }
    free(t);
    return ok;
}

bool cfg_check_bounds(const struct cfg_key *k, const struct config *c, char *msg, size_t cap)
{
    const void *field = (const char *)c + k->offset;
    char v[48];
    switch (k->type) {
    case CFG_INT:
        snprintf(v, sizeof v, "%d", *(const int *)field);
        return in_bounds(k, *(const int *)field) || bounds_error(k, v, msg, cap);
    case CFG_DOUBLE:
        cfg_format_double(*(const double *)field, v, sizeof v);
        return in_bounds(k, *(const double *)field) || bounds_error(k, v, msg, cap);
    case CFG_INT_LIST: {
        int n = *(const int *)((const char *)c + k->count_offset);
        for (int i = 0; i < n; i++) {
            int e = ((const int *)field)[i];
            snprintf(v, sizeof v, "%d", e);
            if (!in_bounds(k, e)) return bounds_error(k, v, msg, cap);
        }
        return true;
    }
    case CFG_ENUM: {
        int e = *(const int *)field;
        if (e < 0 || e >= k->n_names) {
            snprintf(msg, cap, "%s.%s holds an invalid value %d", k->section, k->key, e);
            return false;
        }
        return true;
    }
    default:
        return true;
    }
}

void cfg_format_double(double d, char *buf, size_t cap)
{
    char tmp[64];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (strtod(tmp, NULL) == d) break;
    }
    if (isfinite(d) && !strpbrk(tmp, ".e")) {
        snprintf(buf, cap, "%s.0", tmp);
    } else if (isfinite(d) && strchr(tmp, 'e') && !strchr(tmp, '.')) {
        /* "1e-06" -> "1.0e-06": YAML 1.1 readers (PyYAML) need the dot to see a float */
        char *e = strchr(tmp, 'e');
        snprintf(buf, cap, "%.*s.0%s", (int)(e - tmp), tmp, e);
    } else {
        snprintf(buf, cap, "%s", tmp);
    }
}

/* Double-quoted YAML scalar: paths may hold ':' '#' or leading blanks that plain style would eat. */
static int format_string(const char *s, char *buf, size_t cap)
{
    size_t n = 0;
#define PUT(ch) do { if (n + 1 < cap) buf[n] = (ch); n++; } while (0)
    PUT('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            PUT('\\');
            PUT((char)*p);
        } else if (*p < 0x20) {
            char esc[8];
            snprintf(esc, sizeof esc, "\\x%02x", *p);
            for (char *e = esc; *e; e++) PUT(*e);
        } else {
            PUT((char)*p);
        }
    }
    PUT('"');
#undef PUT
    if (cap) buf[MT_MIN(n, cap - 1)] = 0;
    return (int)n;
}

int cfg_format_value(const struct cfg_key *k, const struct config *c, char *buf, size_t cap)
{
    const void *field = (const char *)c + k->offset;
    char d[64];
    switch (k->type) {
    case CFG_INT:
        return snprintf(buf, cap, "%d", *(const int *)field);
    case CFG_U64:
        return snprintf(buf, cap, "%" PRIu64, *(const uint64_t *)field);
    case CFG_DOUBLE:
        cfg_format_double(*(const double *)field, d, sizeof d);
        return snprintf(buf, cap, "%s", d);
    case CFG_BOOL:
        return snprintf(buf, cap, "%s", *(const bool *)field ? "true" : "false");
    case CFG_STRING:
        return format_string(field, buf, cap);
    case CFG_ENUM: {
        int e = *(const int *)field;
        return snprintf(buf, cap, "%s", e >= 0 && e < k->n_names ? k->names[e] : "invalid");
    }
    case CFG_INT_LIST: {
        int n = *(const int *)((const char *)c + k->count_offset);
        int total = 0;
        for (int i = 0; i <= n; i++) {
            char piece[24];
            if (i == n) snprintf(piece, sizeof piece, "%s]", n == 0 ? "[" : "");
            else snprintf(piece, sizeof piece, "%s%d", i ? ", " : "[", ((const int *)field)[i]);
            size_t used = MT_MIN((size_t)total, cap);
            total += snprintf(buf + used, cap - used, "%s", piece);
        }
        return total;
    }
    }
    return 0;
}
