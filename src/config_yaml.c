/* The YAML side of config loading: libyaml documents walked section by section into the key table
 * (scalars, integer lists, string lists, the data.validation mapping), and --set section.key=value
 * strings. Separate from config_load.c because it is the only part that knows libyaml. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "config_loader.h"

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

bool cfg_load_yaml_text(struct loader *L, const char *text, size_t len)
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

/* ---- --set section.key=value --------------------------------------------------------------- */

bool cfg_apply_set(struct loader *L, int i)
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
