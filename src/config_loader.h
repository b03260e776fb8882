/* What the config_*.c files that load a config share: struct loader (the config being filled and,
 * per key, where its value came from) and the helpers that turn that origin into the FILE:LINE:COL,
 * --set or JSON location an error names. Private to the loader files (config_load.c, config_yaml.c,
 * config_hf_apply.c, config_validate.c): config.h stays the public API. */
#ifndef MT_CONFIG_LOADER_H
#define MT_CONFIG_LOADER_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "config.h"
#include "config_table.h"

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

static inline bool fail(struct loader *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline bool fail(struct loader *L, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->err, L->errcap, fmt, ap);
    va_end(ap);
    return false;
}

static inline const char *file_name(const struct loader *L)
{
    return L->file && *L->file ? L->file : "config";
}

static inline void where(const struct loader *L, int idx, char *buf, size_t cap)
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

static inline int key_index(const char *section, const char *key)
{
    int i = cfg_find(section, key);
    if (i < 0) mt_fatal("config table has no %s.%s", section, key);
    return i;
}

/* Location for a problem involving two keys: where the user most recently decided one of them. */
static inline void where2(const struct loader *L, const char *sa, const char *ka, const char *sb,
                          const char *kb, char *buf, size_t cap)
{
    int a = key_index(sa, ka), b = key_index(sb, kb);
    where(L, L->org[b].kind > L->org[a].kind ? b : a, buf, cap);
}

/* The steps of loading, in the order load_common (config_load.c) runs them. Each returns false after
 * writing the one-line error into L->err. */
bool cfg_load_yaml_text(struct loader *L, const char *text, size_t len);  /* config_yaml.c */
bool cfg_apply_set(struct loader *L, int i);                               /* config_yaml.c */
bool cfg_apply_hf_config(struct loader *L);                                /* config_hf_apply.c */
bool cfg_apply_init_from_config(struct loader *L);                         /* config_hf_apply.c */
bool cfg_validate(struct loader *L);                                       /* config_validate.c */

#endif
