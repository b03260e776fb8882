/* Applying a Hugging Face config.json to a config being loaded: model.hf_config (the JSON fills
 * the model keys the YAML and --set leave unset) and model.init_from naming a Hugging Face
 * directory (its config.json decides the model keys, and a YAML key that disagrees is an error).
 * Reading the JSON itself is config_hf.c; this file decides precedence between it and the YAML. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config_loader.h"

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

bool cfg_apply_hf_config(struct loader *L)
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

bool cfg_apply_init_from_config(struct loader *L)
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
