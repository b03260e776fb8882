/* Config loading: defaults < model.hf_config JSON < YAML file < --set, then validation. Every key
 * goes through the table in config_table.c; the loader walks YAML documents and --set strings into it
 * and remembers where each value came from, so that every error names FILE:LINE:COLUMN (or the --set
 * or JSON file responsible). This file holds the defaults, the public entry points that run those
 * steps in order, and config_to_yaml; the steps themselves are config_yaml.c (YAML and --set),
 * config_hf_apply.c (hf_config / init_from JSON) and config_validate.c (cross-key checks). */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_internal.h"

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
    c->parallel.reshard_after_forward = MT_TRI_AUTO;
    c->parallel.expert_wgrad_pairs = MT_TRI_AUTO;
    c->parallel.wgrad_pair_layers = MT_MAX_LAYERS;
    c->parallel.expert_wgrad_group = 0;
    c->parallel.expert_wgrad_jobs = false;
    c->parallel.wgrad_group_layers = 0;
    c->parallel.wgrad_group = 2;
    c->parallel.prefetch = true;
    c->parallel.reduce_grads = MT_REDUCE_AUTO;
    c->parallel.moe_chunks = 1;
    c->parallel.moe_fixed_exchange = MT_TRI_AUTO;
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

bool config_moe_fixed_exchange(const struct config *c)
{
    const struct parallel_config *p = &c->parallel;
    if (p->moe_fixed_exchange != MT_TRI_AUTO) return p->moe_fixed_exchange == MT_TRI_TRUE;
    const int ep = p->expert_parallel_size, k = c->model.num_experts_per_tok;
    if (ep < 2 || p->moe_chunks != 1 || p->pipeline_parallel_size != 1 || k < 1) return false;
    return 1.0 - pow(1.0 - 1.0 / ep, k) >= 0.75;
}

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
