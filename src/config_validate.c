/* Checks of a loaded config that no single key's bounds can express: relations between keys
 * (heads vs kv heads, pipeline_layers vs layers, data.path vs data.sources, ...). Each error names
 * the location of whichever of the two keys the user set last. Separate from loading because
 * config_validate also runs it on configs built in code, with no YAML behind them. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "config_loader.h"
#include "router_opts.h"

/* ---- validation ---------------------------------------------------------------------------- */

bool cfg_validate(struct loader *L)
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
    CHECK2(c->parallel.moe_chunks <= micro_tokens, "parallel", "moe_chunks", "parallel", "moe_chunks",
           "parallel.moe_chunks (%d) must be <= the tokens of a micro-batch (train.seq_len x "
           "train.micro_batch_size = %lld): every chunk needs a token", c->parallel.moe_chunks,
           (long long)micro_tokens);
    CHECK2(c->parallel.expert_wgrad_pairs != MT_TRI_TRUE || c->parallel.moe_chunks == 1, "parallel",
           "expert_wgrad_pairs", "parallel", "moe_chunks",
           "parallel.expert_wgrad_pairs: true needs parallel.moe_chunks: 1 (the chunked exchange runs "
           "its own expert backward)");
    CHECK2(c->parallel.moe_fixed_exchange != MT_TRI_TRUE || c->parallel.moe_chunks == 1, "parallel",
           "moe_fixed_exchange", "parallel", "moe_chunks",
           "parallel.moe_fixed_exchange: true needs parallel.moe_chunks: 1 (the chunked exchange sizes "
           "its transfers from the counts)");
    CHECK2(c->parallel.moe_fixed_exchange != MT_TRI_TRUE || c->parallel.pipeline_parallel_size == 1, "parallel",
           "moe_fixed_exchange", "parallel", "pipeline_parallel_size",
           "parallel.moe_fixed_exchange: true needs parallel.pipeline_parallel_size: 1 (a pipelined "
           "step cannot be run again when an MoE layer outgrows its rows)");
    CHECK2(!c->parallel.expert_wgrad_jobs || (c->parallel.expert_parallel_size > 1 &&
                                              c->parallel.expert_wgrad_pairs != MT_TRI_FALSE &&
                                              c->parallel.moe_chunks == 1),
           "parallel", "expert_wgrad_jobs", "parallel", "expert_parallel_size",
           "parallel.expert_wgrad_jobs: true needs parallel.expert_parallel_size > 1 (the waits it fills), "
           "parallel.expert_wgrad_pairs not false and parallel.moe_chunks: 1");
    CHECK2(c->parallel.expert_wgrad_group != 1, "parallel", "expert_wgrad_group", "parallel",
           "expert_wgrad_group",
           "parallel.expert_wgrad_group is 2 to 8 micro-steps, or 0 (auto); to never group set "
           "parallel.expert_wgrad_pairs: false");
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
    CHECK2(c->train.master_weights != MT_MASTER_SPLIT || m->precision == MT_PREC_BF16, "train", "master_weights",
           "model", "precision", "train.master_weights: split needs model.precision: bf16 (its high half is the bf16 compute copy)");
    CHECK2(c->train.master_weights != MT_MASTER_SPLIT || c->train.weight_copy != MT_COPY_CAST, "train",
           "master_weights", "train", "weight_copy",
           "train.master_weights: split keeps the compute copy (it is the master's high half): not with train.weight_copy: cast");
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
    bool ok = cfg_validate(L);
    free(L);
    return ok;
}
