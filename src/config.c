/* Config loading: defaults < model.hf_config JSON < YAML file < --set, then validation. Every key
 * goes through the table in config_table.c; this file walks YAML documents and --set strings into it
 * and remembers where each value came from, so that every error names FILE:LINE:COLUMN (or the --set
 * or JSON file responsible). */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

#include "config_table.h"
#include "router_opts.h"

#define MAX_CONFIG_BYTES (16u << 20)

void config_defaults(struct config *c)
{
    memset(c, 0, sizeof *c);
    struct model_config *m = &c->model;
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
    m->decoder_sparse_step = 1;
    m->n_mlp_only_layers = 0;
    m->norm_topk_prob = true;
    m->tie_word_embeddings = false;
    m->rope_theta = 1e6;
    m->rms_norm_eps = 1e-6;
    m->router_aux_loss_coef = 0.01;
    m->initializer_range = 0.02;
    m->max_position_embeddings = 4096;
    m->precision = MT_PREC_BF16;
    m->router_fp32 = true;
    m->freeze_router = false;
    m->train_router = true;
    m->router_weight_decay = false;
    m->scoring = MT_SCORE_SOFTMAX;
    m->route_scale = 1.0;
    m->n_group = 1;
    m->topk_group = 0;
    m->debug_force_balance = false;

    c->parallel.pipeline_parallel_size = 1;
    c->parallel.expert_parallel_size = 1;
    c->parallel.ep_outside = false;
    c->parallel.n_pipeline_layers = 0;
    c->parallel.reshard_after_forward = true;
    c->parallel.prefetch = true;
    c->parallel.backend = MT_BACKEND_AUTO;

    struct train_config *t = &c->train;
    t->steps = 100;
    t->seq_len = 64;
    t->global_batch_size = 8;
    t->micro_batch_size = 2;
    t->lr = 3e-3;
    t->min_lr = 3e-4;
    t->warmup_steps = 10;
    t->weight_decay = 0.1;
    t->beta1 = 0.9;
    t->beta2 = 0.95;
    t->adam_eps = 1e-8;
    t->grad_clip = 1.0;
    t->seed = 1234;
    t->activation_checkpointing = false;
    t->load_balance = MT_LB_AUX;
    t->weight_copy = MT_COPY_AUTO;
    t->optimizer_state_dtype = MT_STATE_FP32;
    t->bias_update_rate = 1e-3;
    t->watchdog_s = 600;
    t->aux_loss_scope = MT_AUX_MICRO_BATCH;
    t->nonfinite = MT_NONFINITE_SKIP;
    t->max_skipped_steps = 5;
    t->spike_factor = 0;

    c->data.kind = MT_DATA_SYNTHETIC;
    c->data.synthetic_branching = 4;
    c->data.seed = 1;
    c->data.eos_id = -1;
    c->data.loss_after_eos = true;
    c->data.validation_interval = 100;
    c->data.validation_batches = 1;
    c->data.synthetic_seed = 42;

    c->checkpoint.interval = 0;
    c->checkpoint.keep = 2;
    c->checkpoint.export_dtype = MT_PREC_BF16;
    c->checkpoint.export_shard_bytes = 5000000000ull;

    c->log.interval = 1;
    c->log.collapse_steps = 50;
    c->log.load_warn = 4.0;
}

int config_head_dim(const struct model_config *m)
{
    if (m->head_dim > 0) return m->head_dim;
    return m->num_attention_heads > 0 ? m->hidden_size / m->num_attention_heads : 0;
}

bool config_layer_is_moe(const struct model_config *m, int layer)
{
    if (m->num_experts <= 0) return false;
    for (int i = 0; i < m->n_mlp_only_layers; i++)
        if (m->mlp_only_layers[i] == layer) return false;
    int step = m->decoder_sparse_step > 0 ? m->decoder_sparse_step : 1;
    return (layer + 1) % step == 0;
}

/* ---- where each value came from ----------------------------------------------------------- */

enum origin_kind { ORG_DEFAULT, ORG_JSON, ORG_YAML, ORG_SET };  /* later = higher precedence */

struct origin {
    enum origin_kind kind;
    int line, col;       /* ORG_YAML, 1-based, of the value */
    int set_index;       /* ORG_SET */
};

struct loader {
    struct config *c;
    const char *file;    /* the YAML file's name for messages, or NULL */
    struct origin org[128];
    char **sets;
    char json_path[MT_PATH_MAX];
    char *err;
    size_t errcap;
};

_Static_assert(sizeof(((struct loader *)0)->org) / sizeof(struct origin) >= 64, "origin slots");

static bool fail(struct loader *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(struct loader *L, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->err, L->errcap, fmt, ap);
    va_end(ap);
    return false;
}

static const char *file_name(const struct loader *L)
{
    return L->file && *L->file ? L->file : "config";
}

static void where(const struct loader *L, int idx, char *buf, size_t cap)
{
    const struct origin *o = &L->org[idx];
    switch (o->kind) {
    case ORG_YAML:
        snprintf(buf, cap, "%s:%d:%d", file_name(L), o->line, o->col);
        break;
    case ORG_SET:
        snprintf(buf, cap, "--set %s.%s", cfg_keys[idx].section, cfg_keys[idx].key);
        break;
    case ORG_JSON:
        snprintf(buf, cap, "%s", L->json_path);
        break;
    case ORG_DEFAULT:
        snprintf(buf, cap, "%s", file_name(L));
        break;
    }
}

static int key_index(const char *section, const char *key)
{
    int i = cfg_find(section, key);
    if (i < 0) mt_fatal("config table has no %s.%s", section, key);
    return i;
}

/* Location for a problem involving two keys: where the user most recently decided one of them. */
static void where2(const struct loader *L, const char *sa, const char *ka, const char *sb,
                   const char *kb, char *buf, size_t cap)
{
    int a = key_index(sa, ka), b = key_index(sb, kb);
    where(L, L->org[b].kind > L->org[a].kind ? b : a, buf, cap);
}

/* ---- YAML ---------------------------------------------------------------------------------- */

static bool yaml_is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return false;
    const char *v = (const char *)n->data.scalar.value;
    return !*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") || !strcmp(v, "NULL");
}

static const char *node_kind(const yaml_node_t *n)
{
    return n->type == YAML_MAPPING_NODE ? "a mapping" : n->type == YAML_SEQUENCE_NODE ? "a sequence"
                                                                                     : "a scalar";
}

#define MARK(n) (int)(n)->start_mark.line + 1, (int)(n)->start_mark.column + 1

/* libyaml's own problem text and position. Reader errors (bad UTF-8) carry only a byte offset. */
static bool yaml_problem(struct loader *L, const yaml_parser_t *p, const char *text, size_t len)
{
    const char *problem = p->problem ? p->problem : "out of memory";
    if (p->error == YAML_READER_ERROR) {
        int line = 1, col = 1;
        for (size_t i = 0; i < p->problem_offset && i < len; i++) {
            if (text[i] == '\n') { line++; col = 1; } else col++;
        }
        return fail(L, "%s:%d:%d: malformed YAML: %s", file_name(L), line, col, problem);
    }
    if (p->context)
        return fail(L, "%s:%d:%d: malformed YAML: %s (%s at line %d, column %d)", file_name(L),
                    (int)p->problem_mark.line + 1, (int)p->problem_mark.column + 1, problem,
                    p->context, (int)p->context_mark.line + 1, (int)p->context_mark.column + 1);
    return fail(L, "%s:%d:%d: malformed YAML: %s", file_name(L), (int)p->problem_mark.line + 1,
                (int)p->problem_mark.column + 1, problem);
}

/* A YAML sequence for a string key: data.path's files joined with ',', or data.sources' mappings
 * {path, weight} as "path:weight,..." (the same text --set and config_to_yaml use). */
static bool load_string_list(struct loader *L, yaml_document_t *doc, const struct cfg_key *k,
                             yaml_node_t *v)
{
    const bool weighted = !strcmp(k->key, "sources");
    char *field = (char *)L->c + k->offset;
    size_t len = 0;
    field[0] = 0;
    for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top; it++) {
        yaml_node_t *e = yaml_document_get_node(doc, *it);
        if (!e) return fail(L, "%s:%d:%d: libyaml returned no node", file_name(L), MARK(v));
        const char *path = NULL, *weight = NULL;
        if (!weighted && e->type == YAML_SCALAR_NODE) {
            path = (const char *)e->data.scalar.value;
        } else if (weighted && e->type == YAML_MAPPING_NODE) {
            for (yaml_node_pair_t *pr = e->data.mapping.pairs.start; pr < e->data.mapping.pairs.top;
                 pr++) {
                yaml_node_t *kn = yaml_document_get_node(doc, pr->key);
                yaml_node_t *vn = yaml_document_get_node(doc, pr->value);
                if (!kn || !vn || kn->type != YAML_SCALAR_NODE || vn->type != YAML_SCALAR_NODE)
                    return fail(L, "%s:%d:%d: data.sources entries are {path: FILES, weight: W}",
                                file_name(L), MARK(e));
                const char *name = (const char *)kn->data.scalar.value;
                if (!strcmp(name, "path")) path = (const char *)vn->data.scalar.value;
                else if (!strcmp(name, "weight")) weight = (const char *)vn->data.scalar.value;
                else
                    return fail(L, "%s:%d:%d: unknown key '%s' in a data.sources entry (path, weight)",
                                file_name(L), MARK(kn), name);
            }
            if (!path || !weight)
                return fail(L, "%s:%d:%d: a data.sources entry needs both path and weight",
                            file_name(L), MARK(e));
        } else {
            return fail(L, "%s:%d:%d: %s.%s expects a list of %s, got %s as an element",
                        file_name(L), MARK(e), k->section, k->key,
                        weighted ? "{path, weight} mappings" : "paths", node_kind(e));
        }
        if (strchr(path, ','))
            return fail(L, "%s:%d:%d: %s.%s: the path '%s' contains a ',' (not supported in lists)",
                        file_name(L), MARK(e), k->section, k->key, path);
        int n = snprintf(field + len, k->size - len, "%s%s%s%s", len ? "," : "", path,
                         weight ? ":" : "", weight ? weight : "");
        if (n < 0 || (size_t)n >= k->size - len)
            return fail(L, "%s:%d:%d: %s.%s is longer than %zu bytes", file_name(L), MARK(e),
                        k->section, k->key, k->size - 1);
        len += (size_t)n;
    }
    return true;
}

static bool load_nested(struct loader *L, yaml_document_t *doc, const char *section,
                        const char *key, yaml_node_t *map);

static bool load_value(struct loader *L, yaml_document_t *doc, int idx, yaml_node_t *v)
{
    const struct cfg_key *k = &cfg_keys[idx];
    char msg[768], desc[128];
    if (v->type == YAML_SCALAR_NODE) {
        if (!cfg_parse_scalar(k, L->c, (const char *)v->data.scalar.value, yaml_is_null(v), msg,
                              sizeof msg))
            return fail(L, "%s:%d:%d: %s", file_name(L), MARK(v), msg);
        return true;
    }
    if (v->type == YAML_SEQUENCE_NODE && k->type == CFG_INT_LIST) {
        cfg_list_clear(k, L->c);
        for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(doc, *it);
            if (!e) return fail(L, "%s:%d:%d: libyaml returned no node", file_name(L), MARK(v));
            if (e->type != YAML_SCALAR_NODE)
                return fail(L, "%s:%d:%d: %s.%s expects a list of integers, got %s as an element",
                            file_name(L), MARK(e), k->section, k->key, node_kind(e));
            if (!cfg_list_append(k, L->c, (const char *)e->data.scalar.value, msg, sizeof msg))
                return fail(L, "%s:%d:%d: %s", file_name(L), MARK(e), msg);
        }
        return true;
    }
    if (v->type == YAML_SEQUENCE_NODE && idx == key_index("train", "no_decay_modules")) {
        /* a list of names, kept as its "[a, b]" text: router_opts.c parses it */
        char text[sizeof L->c->train.no_decay_modules] = "[";
        for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(doc, *it);
            if (!e || e->type != YAML_SCALAR_NODE)
                return fail(L, "%s:%d:%d: train.no_decay_modules expects a list of module names",
                            file_name(L), MARK(e ? e : v));
            size_t n = strlen(text);
            if (snprintf(text + n, sizeof text - n, "%s%s", n > 1 ? ", " : "",
                         (const char *)e->data.scalar.value) >= (int)(sizeof text - n))
                return fail(L, "%s:%d:%d: train.no_decay_modules is too long", file_name(L), MARK(v));
        }
        size_t n = strlen(text);
        if (n + 2 > sizeof text)
            return fail(L, "%s:%d:%d: train.no_decay_modules is too long", file_name(L), MARK(v));
        memcpy(text + n, "]", 2);
        return cfg_parse_scalar(k, L->c, text, false, msg, sizeof msg) ||
               fail(L, "%s:%d:%d: %s", file_name(L), MARK(v), msg);
    }
    if (v->type == YAML_SEQUENCE_NODE && k->type == CFG_STRING) return load_string_list(L, doc, k, v);
    return fail(L, "%s:%d:%d: %s.%s expects %s, got %s", file_name(L), MARK(v), k->section, k->key,
                cfg_type_desc(k, desc, sizeof desc), node_kind(v));
}

/* A mapping under key K (data.validation: {path, interval, batches}) sets the keys K_<name>. */
static bool load_nested(struct loader *L, yaml_document_t *doc, const char *section,
                        const char *key, yaml_node_t *map)
{
    for (yaml_node_pair_t *pr = map->data.mapping.pairs.start; pr < map->data.mapping.pairs.top;
         pr++) {
        yaml_node_t *kn = yaml_document_get_node(doc, pr->key);
        yaml_node_t *vn = yaml_document_get_node(doc, pr->value);
        if (!kn || !vn) return fail(L, "%s:%d:%d: libyaml returned no node", file_name(L), MARK(map));
        char flat[160];
        if (kn->type != YAML_SCALAR_NODE ||
            snprintf(flat, sizeof flat, "%s_%s", key, (const char *)kn->data.scalar.value) >=
                (int)sizeof flat)
            return fail(L, "%s:%d:%d: keys under %s.%s must be short names", file_name(L), MARK(kn),
                        section, key);
        int idx = cfg_find(section, flat);
        if (idx < 0)
            return fail(L, "%s:%d:%d: unknown key '%s' under %s.%s", file_name(L), MARK(kn),
                        (const char *)kn->data.scalar.value, section, key);
        if (L->org[idx].kind == ORG_YAML)
            return fail(L, "%s:%d:%d: %s.%s is set twice (already at line %d, column %d)",
                        file_name(L), MARK(kn), section, flat, L->org[idx].line, L->org[idx].col);
        if (!load_value(L, doc, idx, vn)) return false;
        L->org[idx] = (struct origin){ ORG_YAML, MARK(vn), 0 };
    }
    return true;
}

static bool load_section(struct loader *L, yaml_document_t *doc, const char *section,
                         yaml_node_t *sec)
{
    if (yaml_is_null(sec)) return true;  /* "train:" with nothing under it */
    if (sec->type != YAML_MAPPING_NODE)
        return fail(L, "%s:%d:%d: section '%s' must be a mapping of key: value, got %s",
                    file_name(L), MARK(sec), section, node_kind(sec));
    for (yaml_node_pair_t *pr = sec->data.mapping.pairs.start; pr < sec->data.mapping.pairs.top;
         pr++) {
        yaml_node_t *kn = yaml_document_get_node(doc, pr->key);
        yaml_node_t *vn = yaml_document_get_node(doc, pr->value);
        if (!kn || !vn) return fail(L, "%s:%d:%d: libyaml returned no node", file_name(L), MARK(sec));
        if (kn->type != YAML_SCALAR_NODE)
            return fail(L, "%s:%d:%d: keys in section '%s' must be names, got %s", file_name(L),
                        MARK(kn), section, node_kind(kn));
        const char *key = (const char *)kn->data.scalar.value;
        int idx = cfg_find(section, key);
        if (idx < 0 && vn->type == YAML_MAPPING_NODE && !strcmp(section, "data") &&
            !strcmp(key, "validation")) {
            if (!load_nested(L, doc, section, key, vn)) return false;
            continue;
        }
        if (idx < 0) {
            char hint[160];
            cfg_suggest_key(section, key, hint, sizeof hint);
            return fail(L, "%s:%d:%d: unknown key '%s' in section '%s'%s", file_name(L), MARK(kn),
                        key, section, hint);
        }
        if (L->org[idx].kind == ORG_YAML)
            return fail(L, "%s:%d:%d: duplicate key '%s' in section '%s' (already set at line %d, "
                        "column %d)", file_name(L), MARK(kn), key, section, L->org[idx].line,
                        L->org[idx].col);
        if (!load_value(L, doc, idx, vn)) return false;
        L->org[idx] = (struct origin){ ORG_YAML, MARK(vn), 0 };
    }
    return true;
}

static bool load_document(struct loader *L, yaml_document_t *doc)
{
    yaml_node_t *root = yaml_document_get_root_node(doc);
    if (!root || yaml_is_null(root)) return true;  /* empty file: all defaults */
    if (root->type != YAML_MAPPING_NODE)
        return fail(L, "%s:%d:%d: the top level must be a mapping of sections (model:, train:, ...), "
                    "got %s", file_name(L), MARK(root), node_kind(root));
    int seen_line[16] = { 0 };
    for (yaml_node_pair_t *pr = root->data.mapping.pairs.start; pr < root->data.mapping.pairs.top;
         pr++) {
        yaml_node_t *kn = yaml_document_get_node(doc, pr->key);
        yaml_node_t *vn = yaml_document_get_node(doc, pr->value);
        if (!kn || !vn) return fail(L, "%s:%d:%d: libyaml returned no node", file_name(L), MARK(root));
        if (kn->type != YAML_SCALAR_NODE)
            return fail(L, "%s:%d:%d: section names must be plain names, got %s", file_name(L),
                        MARK(kn), node_kind(kn));
        const char *section = (const char *)kn->data.scalar.value;
        int s = -1;
        for (int i = 0; i < cfg_n_sections; i++)
            if (!strcmp(cfg_sections[i], section)) s = i;
        if (s < 0) {
            char hint[160];
            cfg_suggest_section(section, hint, sizeof hint);
            return fail(L, "%s:%d:%d: unknown section '%s'%s", file_name(L), MARK(kn), section, hint);
        }
        if (seen_line[s])
            return fail(L, "%s:%d:%d: duplicate section '%s' (already at line %d)", file_name(L),
                        MARK(kn), section, seen_line[s]);
        seen_line[s] = (int)kn->start_mark.line + 1;
        if (!load_section(L, doc, section, vn)) return false;
    }
    return true;
}

static bool load_yaml_text(struct loader *L, const char *text, size_t len)
{
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return fail(L, "%s: libyaml could not initialise a parser (out of memory)", file_name(L));
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    yaml_document_t doc;
    if (!yaml_parser_load(&p, &doc)) {
        yaml_problem(L, &p, text, len);
        yaml_parser_delete(&p);
        return false;
    }
    bool ok = load_document(L, &doc);
    yaml_document_delete(&doc);
    if (ok) {
        /* a second document would be silently ignored otherwise */
        if (!yaml_parser_load(&p, &doc)) {
            ok = yaml_problem(L, &p, text, len);
        } else {
            yaml_node_t *extra = yaml_document_get_root_node(&doc);
            if (extra)
                ok = fail(L, "%s:%d:%d: a config holds one YAML document; found another here",
                          file_name(L), MARK(extra));
            yaml_document_delete(&doc);
        }
    }
    yaml_parser_delete(&p);
    return ok;
}

static bool read_whole_file(struct loader *L, const char *path, char **out, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fail(L, "%s: cannot open config: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = mt_malloc(cap);
    for (;;) {
        if (n == cap) {
            if (cap >= MAX_CONFIG_BYTES) {
                free(buf);
                fclose(f);
                return fail(L, "%s: config file is larger than %u bytes", path, MAX_CONFIG_BYTES);
            }
            cap *= 2;
            buf = mt_realloc(buf, cap);
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        int e = errno;
        free(buf);
        fclose(f);
        return fail(L, "%s: cannot read config: %s", path, strerror(e));
    }
    if (fclose(f) != 0) {
        free(buf);
        return fail(L, "%s: cannot close config: %s", path, strerror(errno));
    }
    *out = buf;
    *len = n;
    return true;
}

/* ---- --set section.key=value --------------------------------------------------------------- */

static bool apply_set(struct loader *L, int i)
{
    const char *s = L->sets[i];
    const char *eq = strchr(s, '=');
    const char *dot = eq ? memchr(s, '.', (size_t)(eq - s)) : NULL;
    if (!eq || !dot || dot == s)
        return fail(L, "--set '%s': expected section.key=value", s);
    char section[64], key[128], msg[768], hint[160];
    size_t sl = (size_t)(dot - s), kl = (size_t)(eq - dot - 1);
    if (sl >= sizeof section || kl >= sizeof key)
        return fail(L, "--set '%.60s': section or key name too long", s);
    memcpy(section, s, sl);
    section[sl] = 0;
    memcpy(key, dot + 1, kl);
    key[kl] = 0;
    if (!cfg_section_known(section)) {
        cfg_suggest_section(section, hint, sizeof hint);
        return fail(L, "--set %s.%s: unknown section '%s'%s", section, key, section, hint);
    }
    int idx = cfg_find(section, key);
    if (idx < 0) {
        cfg_suggest_key(section, key, hint, sizeof hint);
        return fail(L, "--set %s.%s: unknown key '%s' in section '%s'%s", section, key, key, section,
                    hint);
    }
    if (!cfg_parse_scalar(&cfg_keys[idx], L->c, eq + 1, false, msg, sizeof msg))
        return fail(L, "--set %s.%s: %s", section, key, msg);
    L->org[idx] = (struct origin){ ORG_SET, 0, 0, i };
    return true;
}

/* ---- model.hf_config ----------------------------------------------------------------------- */

/* Keys of the model section that config.json does not hold: the JSON never decides them. */
static bool moetrain_only(const char *key)
{
    static const char *const own[] = { "hf_config", "init_from", "precision", "router_fp32",
                                       "freeze_router", "train_router", "router_weight_decay",
                                       "scoring", "route_scale", "n_group", "topk_group",
                                       "debug_force_balance" };
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
        if (!strcmp(own[i], key)) return true;
    return false;
}

static bool apply_hf_config(struct loader *L)
{
    struct config *c = L->c;
    int hf = key_index("model", "hf_config");
    char loc[MT_PATH_MAX + 64], joined[2 * MT_PATH_MAX + 2];
    where(L, hf, loc, sizeof loc);
    const char *given = c->model.hf_config;
    /* relative to the YAML file's directory when written there; to the working directory when
     * given by --set (which the user types relative to where they stand) */
    const char *slash = L->file ? strrchr(L->file, '/') : NULL;
    if (given[0] != '/' && L->org[hf].kind == ORG_YAML && slash)
        snprintf(joined, sizeof joined, "%.*s/%s", (int)(slash - L->file), L->file, given);
    else
        snprintf(joined, sizeof joined, "%s", given);
    char *real = realpath(joined, NULL);
    if (!real) return fail(L, "%s: model.hf_config: cannot open '%s': %s", loc, joined, strerror(errno));
    bool fits = mt_strlcpy(L->json_path, real, sizeof L->json_path);
    free(real);
    if (!fits) return fail(L, "%s: model.hf_config: path '%.80s...' too long", loc, joined);

    struct config *j = mt_malloc(sizeof *j);
    *j = *c;
    char msg[1024];
    if (!config_read_hf_json(&j->model, L->json_path, msg, (int)sizeof msg)) {
        free(j);
        return fail(L, "%s", msg);
    }
    mt_strlcpy(j->model.hf_config, L->json_path, sizeof j->model.hf_config);
    /* YAML and --set outrank the JSON: put their values back */
    for (int i = 0; i < cfg_n_keys; i++) {
        const struct cfg_key *k = &cfg_keys[i];
        if (k->alias || strcmp(k->section, "model") != 0 || moetrain_only(k->key)) continue;
        if (L->org[i].kind == ORG_DEFAULT) {
            L->org[i].kind = ORG_JSON;
            continue;
        }
        memcpy((char *)j + k->offset, (const char *)c + k->offset, k->size);
        if (k->type == CFG_INT_LIST)
            memcpy((char *)j + k->count_offset, (const char *)c + k->count_offset, sizeof(int));
    }
    c->model = j->model;
    free(j);
    return true;
}

/* model.init_from naming a Hugging Face directory (not a checkpoint) whose config.json exists and
 * no model.hf_config: that file decides the model keys, as hf_config would, and a key also written
 * in the YAML or --set must agree with it, because the weights have the file's shapes. Training
 * hyper-parameters that config.json also carries may differ. */
static bool lenient_init_key(const char *key)
{
    static const char *const own[] = { "router_aux_loss_coef", "initializer_range", "max_position_embeddings" };
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
        if (!strcmp(own[i], key)) return true;
    return false;
}

static bool apply_init_from_config(struct loader *L)
{
    struct config *c = L->c;
    char dir_json[MT_PATH_MAX + 32], manifest[MT_PATH_MAX + 32];
    snprintf(dir_json, sizeof dir_json, "%s/config.json", c->model.init_from);
    snprintf(manifest, sizeof manifest, "%s/manifest.h5", c->model.init_from);
    struct stat st;
    if (stat(dir_json, &st) != 0 || stat(manifest, &st) == 0) return true;
    struct config *j = mt_malloc(sizeof *j);
    *j = *c;
    char msg[1024];
    if (!config_read_hf_json(&j->model, dir_json, msg, (int)sizeof msg)) {
        free(j);
        return fail(L, "%s (model.init_from)", msg);
    }
    for (int i = 0; i < cfg_n_keys; i++) {
        const struct cfg_key *k = &cfg_keys[i];
        if (k->alias || strcmp(k->section, "model") != 0 || moetrain_only(k->key)) continue;
        if (L->org[i].kind == ORG_DEFAULT) {
            L->org[i].kind = ORG_JSON;
            continue;
        }
        char mine[256], theirs[256], loc[MT_PATH_MAX + 64];
        cfg_format_value(k, c, mine, sizeof mine);
        cfg_format_value(k, j, theirs, sizeof theirs);
        if (!strcmp(mine, theirs) || lenient_init_key(k->key)) {
            memcpy((char *)j + k->offset, (const char *)c + k->offset, k->size);
            if (k->type == CFG_INT_LIST)
                memcpy((char *)j + k->count_offset, (const char *)c + k->count_offset, sizeof(int));
            continue;
        }
        where(L, i, loc, sizeof loc);
        free(j);
        return fail(L, "%s: model.%s is %s but %s (model.init_from) says %s; remove the key or make them agree",
                    loc, k->key, mine, dir_json, theirs);
    }
    c->model = j->model;
    free(j);
    return true;
}

/* ---- validation ---------------------------------------------------------------------------- */

static bool validate(struct loader *L)
{
    struct config *c = L->c;
    struct model_config *m = &c->model;
    char loc[MT_PATH_MAX + 64], msg[768];
    for (int i = 0; i < cfg_n_keys; i++) {
        if (cfg_keys[i].alias || cfg_check_bounds(&cfg_keys[i], c, msg, sizeof msg)) continue;
        where(L, i, loc, sizeof loc);
        return fail(L, "%s: %s", loc, msg);
    }
#define CHECK2(cond, sa, ka, sb, kb, ...)                                   \
    do {                                                                    \
        if (!(cond)) {                                                      \
            where2(L, sa, ka, sb, kb, loc, sizeof loc);                     \
            snprintf(msg, sizeof msg, __VA_ARGS__);                         \
            return fail(L, "%s: %s", loc, msg);                             \
        }                                                                   \
    } while (0)

    CHECK2(m->num_attention_heads % m->num_key_value_heads == 0, "model", "num_attention_heads",
           "model", "num_key_value_heads",
           "model.num_attention_heads (%d) must be a multiple of model.num_key_value_heads (%d)",
           m->num_attention_heads, m->num_key_value_heads);
    CHECK2(m->num_experts == 0 || m->num_experts_per_tok <= m->num_experts, "model",
           "num_experts_per_tok", "model", "num_experts",
           "model.num_experts_per_tok (%d) must be <= model.num_experts (%d)",
           m->num_experts_per_tok, m->num_experts);
    int D = config_head_dim(m);
    if (m->head_dim > 0)
        CHECK2(D % 2 == 0, "model", "head_dim", "model", "head_dim",
               "model.head_dim (%d) must be even (RoPE rotates pairs of dimensions)", D);
    else
        CHECK2(D >= 2 && D % 2 == 0, "model", "hidden_size", "model", "num_attention_heads",
               "model.head_dim is 0, so it is hidden_size / num_attention_heads = %d / %d = %d, "
               "which must be even and >= 2 (or set model.head_dim)",
               m->hidden_size, m->num_attention_heads, D);
    for (int i = 0; i < m->n_mlp_only_layers; i++)
        CHECK2(m->mlp_only_layers[i] < m->num_hidden_layers, "model", "mlp_only_layers", "model",
               "num_hidden_layers", "model.mlp_only_layers names layer %d but there are only %d "
               "layers (0-based)", m->mlp_only_layers[i], m->num_hidden_layers);
    const struct parallel_config *pc = &c->parallel;
    if (pc->n_pipeline_layers > 0) {
        CHECK2(pc->n_pipeline_layers == pc->pipeline_parallel_size, "parallel", "pipeline_layers",
               "parallel", "pipeline_parallel_size",
               "parallel.pipeline_layers has %d entries but parallel.pipeline_parallel_size is %d "
               "(one entry per stage)", pc->n_pipeline_layers, pc->pipeline_parallel_size);
        int sum = 0;
        for (int i = 0; i < pc->n_pipeline_layers; i++) sum += pc->pipeline_layers[i];
        CHECK2(sum == m->num_hidden_layers, "parallel", "pipeline_layers", "model", "num_hidden_layers",
               "parallel.pipeline_layers sums to %d layers but model.num_hidden_layers is %d", sum,
               m->num_hidden_layers);
    }
    char why[512];
    CHECK2(router_opts_check(m, why, sizeof why), "model", "n_group", "model", "topk_group", "%s", why);
    struct train_config *t = &c->train;
    unsigned nd_mask;
    CHECK2(no_decay_parse(t->no_decay_modules, &nd_mask, why, sizeof why), "train",
           "no_decay_modules", "train", "no_decay_modules", "%s", why);
    CHECK2(!(nd_mask && L->org[key_index("model", "router_weight_decay")].kind != ORG_DEFAULT), "train",
           "no_decay_modules", "model", "router_weight_decay",
           "train.no_decay_modules decides the router's weight decay too: set it or "
           "model.router_weight_decay, not both");
    CHECK2(t->min_lr <= t->lr, "train", "min_lr", "train", "lr",
           "train.min_lr (%g) must be <= train.lr (%g)", t->min_lr, t->lr);
    CHECK2(t->seq_len >= 2, "train", "seq_len", "train", "seq_len",
           "train.seq_len (%d) must be >= 2: a sequence of n tokens has n - 1 next-token labels, so "
           "1 leaves nothing to train on", t->seq_len);
    /* the kernels index a micro-batch's (token, expert) pairs with int */
    const int64_t micro_tokens = (int64_t)t->seq_len * t->micro_batch_size;
    const int64_t pairs = micro_tokens * MT_MAX(m->num_experts_per_tok, 1);
    CHECK2(pairs <= INT_MAX, "train", "seq_len", "train", "micro_batch_size",
           "train.seq_len x train.micro_batch_size = %lld tokens per micro-batch (x top-%d = %lld "
           "routed pairs) is more than the 32-bit indexing holds (%d): lower micro_batch_size",
           (long long)micro_tokens, m->num_experts_per_tok, (long long)pairs, INT_MAX);
    CHECK2((int64_t)t->seq_len * t->global_batch_size <= INT64_C(1) << 52, "train", "seq_len", "train",
           "global_batch_size", "train.seq_len x train.global_batch_size = %lld tokens per step is "
           "too many to count exactly", (long long)t->seq_len * t->global_batch_size);
    CHECK2(t->spike_factor == 0 || t->spike_factor > 1, "train", "spike_factor", "train", "spike_factor",
           "train.spike_factor (%g) must be 0 (off) or > 1 (skip a step whose loss is that many times "
           "the recent mean)", t->spike_factor);
    CHECK2(t->micro_batch_size <= t->global_batch_size, "train", "micro_batch_size", "train",
           "global_batch_size", "train.micro_batch_size (%d) must be <= train.global_batch_size (%d)",
           t->micro_batch_size, t->global_batch_size);
    CHECK2(c->data.kind != MT_DATA_TOKENS || c->data.path[0] || c->data.sources[0], "data", "kind",
           "data", "path", "data.path is required when data.kind is tokens (the token files to "
           "train on; or data.sources to blend several datasets)");
    CHECK2(!c->data.path[0] || !c->data.sources[0], "data", "path", "data", "sources",
           "data.path and data.sources are both set: give the files once, in data.sources with "
           "their weights or in data.path alone");
    CHECK2(c->data.kind == MT_DATA_TOKENS || !c->data.sources[0], "data", "sources", "data", "kind",
           "data.sources needs data.kind: tokens");
    CHECK2(c->data.kind == MT_DATA_TOKENS || !c->data.validation_path[0], "data", "validation_path",
           "data", "kind", "data.validation_path needs data.kind: tokens");
    CHECK2(!c->data.document_masking || c->data.eos_id >= 0, "data", "document_masking", "data",
           "eos_id", "data.document_masking: true needs data.eos_id (the token that ends a document)");
    CHECK2(c->data.loss_after_eos || c->data.eos_id >= 0, "data", "loss_after_eos", "data", "eos_id",
           "data.loss_after_eos: false needs data.eos_id (the token that ends a document)");
    CHECK2(c->data.eos_id < m->vocab_size, "data", "eos_id", "model", "vocab_size",
           "data.eos_id (%d) must be < model.vocab_size (%d)", c->data.eos_id, m->vocab_size);
    CHECK2(c->data.kind != MT_DATA_SYNTHETIC || c->data.synthetic_branching <= m->vocab_size, "data",
           "synthetic_branching", "model", "vocab_size",
           "data.synthetic_branching (%d) must be <= model.vocab_size (%d)",
           c->data.synthetic_branching, m->vocab_size);
#undef CHECK2
    return true;
}

bool config_validate(struct config *c, char *err, int errcap)
{
    char local[8];
    struct loader *L = mt_calloc(1, sizeof *L);
    L->c = c;
    L->file = c->path;
    L->err = err && errcap > 0 ? err : local;
    L->errcap = err && errcap > 0 ? (size_t)errcap : sizeof local;
    mt_strlcpy(L->json_path, c->model.hf_config, sizeof L->json_path);
    bool ok = validate(L);
    free(L);
    return ok;
}

/* ---- entry points -------------------------------------------------------------------------- */

static bool load_common(struct config *c, const char *name, const char *text, size_t len, bool from_file,
                        int n_sets, char **sets, char *err, int errcap)
{
    char local[1024];
    struct loader *L = mt_calloc(1, sizeof *L);
    L->c = c;
    L->err = err && errcap > 0 ? err : local;
    L->errcap = err && errcap > 0 ? (size_t)errcap : sizeof local;
    L->sets = sets;
    if ((size_t)cfg_n_keys > sizeof L->org / sizeof L->org[0])
        mt_fatal("config table has %d keys, loader tracks %zu", cfg_n_keys,
                 sizeof L->org / sizeof L->org[0]);
    config_defaults(c);
    bool ok = true;
    if (name && !mt_strlcpy(c->path, name, sizeof c->path))
        ok = fail(L, "%.80s...: config path longer than %d bytes", name, MT_PATH_MAX - 1);
    L->file = c->path;
    if (ok && text) ok = load_yaml_text(L, text, len);
    if (ok && text && name && from_file) {
        bool any = false;
        for (int i = 0; i < cfg_n_keys && !any; i++) any = L->org[i].kind == ORG_YAML;
        /* a truncated or mis-copied file must not quietly become a run of the tiny defaults */
        if (!any)
            ok = fail(L, "%s: the config file sets no key (it is empty or holds only comments or empty "
                      "sections); write the keys to train with (docs/config.md)", name);
    }
    for (int i = 0; ok && i < n_sets; i++) ok = apply_set(L, i);
    if (ok && c->model.hf_config[0]) ok = apply_hf_config(L);
    else if (ok && c->model.init_from[0]) ok = apply_init_from_config(L);
    if (ok) ok = validate(L);
    free(L);
    return ok;
}

bool config_load_checked(struct config *c, const char *path, int n_sets, char **sets, char *err,
                         int errcap)
{
    if (!path || !*path) return load_common(c, NULL, NULL, 0, false, n_sets, sets, err, errcap);
    char local[1024];
    struct loader reader = { .file = path };
    reader.err = err && errcap > 0 ? err : local;
    reader.errcap = err && errcap > 0 ? (size_t)errcap : sizeof local;
    char *text = NULL;
    size_t len = 0;
    if (!read_whole_file(&reader, path, &text, &len)) {
        config_defaults(c);
        return false;
    }
    bool ok = load_common(c, path, text, len, true, n_sets, sets, err, errcap);
    free(text);
    return ok;
}

bool config_load_string_checked(struct config *c, const char *name, const char *yaml, size_t len,
                                int n_sets, char **sets, char *err, int errcap)
{
    return load_common(c, name, yaml ? yaml : "", yaml ? len : 0, false, n_sets, sets, err, errcap);
}

void config_load(struct config *c, const char *path, int n_sets, char **sets)
{
    char err[2048];
    if (!config_load_checked(c, path, n_sets, sets, err, (int)sizeof err)) mt_user_error("%s", err);
}

/* ---- printing ------------------------------------------------------------------------------ */

/* snprintf semantics: returns the length of the whole text; writes at most cap-1 chars + NUL. */
int config_to_yaml(const struct config *c, char *buf, int cap)
{
    size_t ucap = buf && cap > 0 ? (size_t)cap : 0, total = 0;
#define OUT(...)                                                                      \
    do {                                                                              \
        size_t used_ = MT_MIN(total, ucap);                                           \
        int w_ = snprintf(ucap ? buf + used_ : NULL, ucap - used_, __VA_ARGS__);      \
        total += w_ > 0 ? (size_t)w_ : 0;                                             \
    } while (0)
    bool name_it = c->path[0] && !strpbrk(c->path, "\r\n");  /* keep the comment one line */
    OUT("# moetrain config%s%s\n", name_it ? " loaded from " : "", name_it ? c->path : "");
    for (int s = 0; s < cfg_n_sections; s++) {
        OUT("%s:\n", cfg_sections[s]);
        for (int i = 0; i < cfg_n_keys; i++) {
            const struct cfg_key *k = &cfg_keys[i];
            if (k->alias || strcmp(k->section, cfg_sections[s]) != 0) continue;
            int need = cfg_format_value(k, c, NULL, 0);
            char *v = mt_malloc((size_t)need + 1);
            cfg_format_value(k, c, v, (size_t)need + 1);
            OUT("  %s: %s\n", k->key, v);
            free(v);
        }
    }
#undef OUT
    return total > INT_MAX ? INT_MAX : (int)total;
}
