/* Reading a Hugging Face Qwen3-MoE config.json into struct model_config.
 *
 * Two spellings exist (spec/qwen3-moe.md): transformers 4.x writes "num_experts" and a top-level
 * "rope_theta"; 5.x writes "num_local_experts" and "rope_parameters": {"rope_theta", "rope_type"}.
 * Both load to the same struct. Structural sizes are required (every file transformers writes has
 * them, and guessing a size builds a silently wrong model); switches that transformers fills from
 * class defaults when absent take those defaults (norm_topk_prob false, decoder_sparse_step 1, ...).
 * Features moetrain does not implement are refused by name rather than ignored. */
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

struct hf {
    const char *path;
    json_t *root;
    char *err;
    size_t errcap;
};

static bool hf_fail(struct hf *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool hf_fail(struct hf *h, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(h->err, h->errcap, "%s: %s", h->path, msg);
    return false;
}

/* The value as compact JSON text, shortened, for messages. */
static const char *json_text(const json_t *v, char *buf, size_t cap)
{
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!s) {
        snprintf(buf, cap, "?");
        return buf;
    }
    if (strlen(s) < cap) snprintf(buf, cap, "%s", s);
    else snprintf(buf, cap, "%.*s...", (int)cap - 4, s);
    free(s);
    return buf;
}

/* A field that is absent or JSON null counts as not given (transformers writes null for unset). */
static json_t *field(const json_t *obj, const char *name)
{
    json_t *v = json_object_get(obj, name);
    return v && !json_is_null(v) ? v : NULL;
}

static bool get_int(struct hf *h, const json_t *obj, const char *prefix, const char *name,
                    bool required, int *out, bool *given)
{
    json_t *v = field(obj, name);
    char b[96];
    if (given) *given = v != NULL;
    if (!v) return !required || hf_fail(h, "missing field '%s%s'", prefix, name);
    if (!json_is_integer(v))
        return hf_fail(h, "field '%s%s' must be an integer, got %s", prefix, name,
                       json_text(v, b, sizeof b));
    json_int_t x = json_integer_value(v);
    if (x < 0 || x > INT_MAX)
        return hf_fail(h, "field '%s%s' is out of range: %" JSON_INTEGER_FORMAT, prefix, name, x);
    *out = (int)x;
    return true;
}

static bool get_double(struct hf *h, const json_t *obj, const char *prefix, const char *name,
                       double *out, bool *given)
{
    json_t *v = field(obj, name);
    char b[96];
    if (given) *given = v != NULL;
    if (!v) return true;
    if (!json_is_number(v) || !isfinite(json_number_value(v)))
        return hf_fail(h, "field '%s%s' must be a number, got %s", prefix, name,
                       json_text(v, b, sizeof b));
    *out = json_number_value(v);
    return true;
}

static bool get_bool(struct hf *h, const char *name, bool *out, bool *given)
{
    json_t *v = field(h->root, name);
    char b[96];
    if (given) *given = v != NULL;
    if (!v) return true;
    if (!json_is_boolean(v))
        return hf_fail(h, "field '%s' must be true or false, got %s", name, json_text(v, b, sizeof b));
    *out = json_is_true(v);
    return true;
}

static bool get_string(struct hf *h, const json_t *obj, const char *prefix, const char *name,
                       const char **out)
{
    json_t *v = field(obj, name);
    char b[96];
    *out = NULL;
    if (!v) return true;
    if (!json_is_string(v))
        return hf_fail(h, "field '%s%s' must be a string, got %s", prefix, name,
                       json_text(v, b, sizeof b));
    *out = json_string_value(v);
    return true;
}

/* rope_parameters (5.x) or rope_scaling (4.x; null for plain RoPE): only rope_type "default" with a
 * full rotary dimension is implemented. Returns the rope_theta found inside, if any. */
static bool check_rope_object(struct hf *h, const char *name, double *theta, bool *has_theta)
{
    *has_theta = false;
    json_t *o = field(h->root, name);
    char b[96];
    if (!o) return true;
    if (!json_is_object(o))
        return hf_fail(h, "field '%s' must be an object or null, got %s", name,
                       json_text(o, b, sizeof b));
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s.", name);
    const char *type = NULL, *old_type = NULL;
    if (!get_string(h, o, prefix, "rope_type", &type)) return false;
    if (!get_string(h, o, prefix, "type", &old_type)) return false;
    if (!type) type = old_type;
    if (!type) {
        /* 5.x nests one rope_parameters object per attention type in models that mix them */
        const char *k;
        json_t *v;
        json_object_foreach(o, k, v) {
            if (json_is_object(v))
                return hf_fail(h, "'%s' holds per-layer-type RoPE settings ('%s'); only one default "
                               "RoPE for all layers is supported", name, k);
        }
    } else if (strcmp(type, "default") != 0) {
        return hf_fail(h, "'%s' asks for rope_type '%s'; only default RoPE is supported (remove "
                       "the RoPE scaling to train at the native context length)", name, type);
    }
    double prf = 1.0;
    bool has_prf = false;
    if (!get_double(h, o, prefix, "partial_rotary_factor", &prf, &has_prf)) return false;
    if (has_prf && prf != 1.0)
        return hf_fail(h, "'%s.partial_rotary_factor' is %g; only full rotary embeddings (1.0) are "
                       "supported", name, prf);
    return get_double(h, o, prefix, "rope_theta", theta, has_theta);
}

static bool refuse_unsupported(struct hf *h)
{
    const char *s = NULL;
    if (!get_string(h, h->root, "", "model_type", &s)) return false;
    if (s && strcmp(s, "qwen3_moe") != 0)
        return hf_fail(h, "model_type '%s' is not supported (moetrain trains qwen3_moe)", s);
    if (!get_string(h, h->root, "", "hidden_act", &s)) return false;
    if (s && strcmp(s, "silu") != 0)
        return hf_fail(h, "hidden_act '%s' is not supported (only silu)", s);
    bool on = false, given = false;
    if (!get_bool(h, "attention_bias", &on, &given)) return false;
    if (on) return hf_fail(h, "attention_bias is true; moetrain's attention has no bias terms");
    on = false;
    if (!get_bool(h, "use_sliding_window", &on, &given)) return false;
    if (on)
        return hf_fail(h, "use_sliding_window is true; only full causal attention is implemented");
    double drop = 0.0;
    if (!get_double(h, h->root, "", "attention_dropout", &drop, &given)) return false;
    if (drop != 0.0)
        return hf_fail(h, "attention_dropout is %g; dropout is not implemented (set it to 0.0)", drop);
    return true;
}

static bool read_fields(struct hf *h, struct model_config *m)
{
    static const struct { const char *name; size_t off; } required[] = {
        { "vocab_size", offsetof(struct model_config, vocab_size) },
        { "hidden_size", offsetof(struct model_config, hidden_size) },
        { "intermediate_size", offsetof(struct model_config, intermediate_size) },
        { "moe_intermediate_size", offsetof(struct model_config, moe_intermediate_size) },
        { "num_hidden_layers", offsetof(struct model_config, num_hidden_layers) },
        { "num_attention_heads", offsetof(struct model_config, num_attention_heads) },
        { "num_key_value_heads", offsetof(struct model_config, num_key_value_heads) },
        { "num_experts_per_tok", offsetof(struct model_config, num_experts_per_tok) },
    };
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!get_int(h, h->root, "", required[i].name, true,
                     (int *)((char *)m + required[i].off), NULL))
            return false;

    /* experts: "num_experts" (4.x) or "num_local_experts" (5.x); both present must agree */
    int e4 = 0, e5 = 0;
    bool has4 = false, has5 = false;
    if (!get_int(h, h->root, "", "num_experts", false, &e4, &has4)) return false;
    if (!get_int(h, h->root, "", "num_local_experts", false, &e5, &has5)) return false;
    if (!has4 && !has5) return hf_fail(h, "missing field 'num_experts' (or 'num_local_experts')");
    if (has4 && has5 && e4 != e5)
        return hf_fail(h, "num_experts (%d) and num_local_experts (%d) disagree", e4, e5);
    m->num_experts = has5 ? e5 : e4;

    /* head_dim: explicit when given (30B-A3B: 128 != 2048/32); else 0 = hidden / heads */
    m->head_dim = 0;
    if (!get_int(h, h->root, "", "head_dim", false, &m->head_dim, NULL)) return false;

    /* rope_theta: top level (4.x) or inside rope_parameters (5.x) */
    double top = 0.0, in_params = 0.0, in_scaling = 0.0;
    bool has_top = false, has_params = false, has_scaling = false;
    if (!get_double(h, h->root, "", "rope_theta", &top, &has_top)) return false;
    if (!check_rope_object(h, "rope_parameters", &in_params, &has_params)) return false;
    if (!check_rope_object(h, "rope_scaling", &in_scaling, &has_scaling)) return false;
    if (has_top && has_params && top != in_params)
        return hf_fail(h, "rope_theta (%g) and rope_parameters.rope_theta (%g) disagree", top,
                       in_params);
    if (has_params) m->rope_theta = in_params;
    else if (has_top) m->rope_theta = top;
    else if (has_scaling) m->rope_theta = in_scaling;
    else return hf_fail(h, "missing field 'rope_theta' (or 'rope_parameters.rope_theta')");

    /* class defaults, shared by transformers 4.x and 5.x, when a field is absent */
    m->decoder_sparse_step = 1;
    m->max_position_embeddings = 32768;
    m->norm_topk_prob = false;
    m->tie_word_embeddings = false;
    m->rms_norm_eps = 1e-6;
    m->router_aux_loss_coef = 0.001;
    m->initializer_range = 0.02;
    if (!get_int(h, h->root, "", "decoder_sparse_step", false, &m->decoder_sparse_step, NULL) ||
        !get_int(h, h->root, "", "max_position_embeddings", false, &m->max_position_embeddings,
                 NULL) ||
        !get_bool(h, "norm_topk_prob", &m->norm_topk_prob, NULL) ||
        !get_bool(h, "tie_word_embeddings", &m->tie_word_embeddings, NULL) ||
        !get_double(h, h->root, "", "rms_norm_eps", &m->rms_norm_eps, NULL) ||
        !get_double(h, h->root, "", "router_aux_loss_coef", &m->router_aux_loss_coef, NULL) ||
        !get_double(h, h->root, "", "initializer_range", &m->initializer_range, NULL))
        return false;

    m->n_mlp_only_layers = 0;
    json_t *list = field(h->root, "mlp_only_layers");
    char b[96];
    if (list) {
        if (!json_is_array(list))
            return hf_fail(h, "field 'mlp_only_layers' must be a list of integers, got %s",
                           json_text(list, b, sizeof b));
        if (json_array_size(list) > MT_MAX_LAYERS)
            return hf_fail(h, "field 'mlp_only_layers' has more than %d entries", MT_MAX_LAYERS);
        size_t i;
        json_t *v;
        json_array_foreach(list, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                json_integer_value(v) >= MT_MAX_LAYERS)
                return hf_fail(h, "field 'mlp_only_layers' element %zu must be a layer index in "
                               "[0, %d), got %s", i, MT_MAX_LAYERS, json_text(v, b, sizeof b));
            m->mlp_only_layers[m->n_mlp_only_layers++] = (int)json_integer_value(v);
        }
    }
    return true;
}

bool config_read_hf_json(struct model_config *m, const char *json_path, char *err, int errcap)
{
    char local[8];
    struct hf h = { json_path, NULL, err && errcap > 0 ? err : local,
                    err && errcap > 0 ? (size_t)errcap : sizeof local };
    json_error_t je;
    h.root = json_load_file(json_path, JSON_REJECT_DUPLICATES, &je);
    if (!h.root) {
        if (je.line > 0)
            snprintf(h.err, h.errcap, "%s:%d:%d: invalid JSON: %s", json_path, je.line, je.column,
                     je.text);
        else
            snprintf(h.err, h.errcap, "%s: %s", json_path, je.text);
        return false;
    }
    bool ok;
    if (!json_is_object(h.root)) {
        ok = hf_fail(&h, "the top level must be a JSON object");
    } else {
        /* fill a copy so that a refused file leaves *m untouched */
        struct model_config *tmp = mt_malloc(sizeof *tmp);
        *tmp = *m;
        ok = refuse_unsupported(&h) && read_fields(&h, tmp);
        if (ok) *m = *tmp;
        free(tmp);
    }
    json_decref(h.root);
    return ok;
}
