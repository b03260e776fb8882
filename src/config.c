/* The config itself: its defaults, the queries the rest of the program asks of it (head_dim,
 * which layers are MoE, whether the fixed exchange is on) and config_to_yaml. Loading a config
 * (defaults < model.hf_config JSON < YAML file < --set, then validation) is config_load.c, which
 * runs the steps in config_yaml.c, config_hf_apply.c and config_validate.c. Every key goes
 * through the table in config_table.c. */
#include "config.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_table.h"

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
    c->parallel.moe_combine_self_last = true;
    c->parallel.wgrad_group_layers = 0;
    c->parallel.wgrad_group = 2;
    c->parallel.wgrad_big_layers = 0;
    c->parallel.stash_in_grads = false;
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
    t->master_weights = MT_MASTER_AUTO;
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

void config_resolve_master_weights(struct config *c, bool bf16_compute)
{
    struct train_config *t = &c->train;
    if (t->master_weights != MT_MASTER_AUTO) return;
    const bool copy = bf16_compute && c->model.precision == MT_PREC_BF16 && t->weight_copy != MT_COPY_CAST;
    t->master_weights = copy ? MT_MASTER_SPLIT : MT_MASTER_FP32;
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
