/* Loading a config: defaults < model.hf_config JSON < YAML file < --set, then validation. Every key
 * goes through the table in config_table.c; the loader (config_loader.h) walks YAML documents and
 * --set strings into it and remembers where each value came from, so that every error names
 * FILE:LINE:COLUMN (or the --set or JSON file responsible). This file holds the public entry
 * points, which run those steps in order: config_yaml.c (YAML and --set), config_hf_apply.c
 * (hf_config / init_from JSON) and config_validate.c (cross-key checks). */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_loader.h"

#define MAX_CONFIG_BYTES (16u << 20)

/* ---- reading the file ---------------------------------------------------------------------- */

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
    if (ok && text) ok = cfg_load_yaml_text(L, text, len);
    if (ok && text && name && from_file) {
        bool any = false;
        for (int i = 0; i < cfg_n_keys && !any; i++) any = L->org[i].kind == ORG_YAML;
        /* a truncated or mis-copied file must not quietly become a run of the tiny defaults */
        if (!any)
            ok = fail(L, "%s: the config file sets no key (it is empty or holds only comments or empty "
                      "sections); write the keys to train with (docs/config.md)", name);
    }
    for (int i = 0; ok && i < n_sets; i++) ok = cfg_apply_set(L, i);
    if (ok && c->model.hf_config[0]) ok = cfg_apply_hf_config(L);
    else if (ok && c->model.init_from[0]) ok = cfg_apply_init_from_config(L);
    if (ok) ok = cfg_validate(L);
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
