#include "tensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct tensor_spec *add(struct tensor_table *tt, int *cap, enum tensor_role role,
                               enum tensor_kind kind, int layer, bool decay, int ndim,
                               int64_t d0, int64_t d1, int64_t d2)
{
    if (tt->n == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        tt->t = mt_realloc(tt->t, (size_t)*cap * sizeof *tt->t);
    }
    struct tensor_spec *s = &tt->t[tt->n++];
    memset(s, 0, sizeof *s);
    s->role = role;
    s->kind = kind;
    s->layer = layer;
    s->decay = decay;
    s->ndim = ndim;
    s->shape[0] = d0;
    s->shape[1] = d1;
    s->shape[2] = d2;
    s->numel = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    return s;
}

/* hf0/hf1: hub names of the (up to two) parts, NULL = same as the stable name. */
static void name_layer(struct tensor_spec *s, int layer, const char *suffix, const char *hf0,
                       const char *hf1)
{
    snprintf(s->name, sizeof s->name, "model.layers.%d.%s", layer, suffix);
    snprintf(s->hf_name[0], sizeof s->hf_name[0], "model.layers.%d.%s", layer, hf0 ? hf0 : suffix);
    s->n_hf = 1;
    if (hf1) {
        snprintf(s->hf_name[1], sizeof s->hf_name[1], "model.layers.%d.%s", layer, hf1);
        s->n_hf = 2;
    }
}

static void name_global(struct tensor_spec *s, const char *name)
{
    snprintf(s->name, sizeof s->name, "%s", name);
    snprintf(s->hf_name[0], sizeof s->hf_name[0], "%s", name);
    s->n_hf = 1;
}

void tensor_table_build(struct tensor_table *tt, const struct model_config *m)
{
    memset(tt, 0, sizeof *tt);
    int cap = 0;
    const int64_t H = m->hidden_size, V = m->vocab_size, D = config_head_dim(m);
    const int64_t Hq = m->num_attention_heads, Hkv = m->num_key_value_heads;
    const int64_t E = m->num_experts, I = m->moe_intermediate_size, Id = m->intermediate_size;
    const int L = m->num_hidden_layers;
    tt->n_layers = L;
    bool router_decay = m->router_weight_decay;
    bool router_frozen = m->freeze_router;

    struct tensor_spec *s = add(tt, &cap, TR_EMBED, TK_DENSE, -1, true, 2, V, H, 0);
    name_global(s, "model.embed_tokens.weight");

    for (int l = 0; l < L; l++) {
        s = add(tt, &cap, TR_ATTN_NORM, TK_NORM, l, false, 1, H, 0, 0);
        name_layer(s, l, "input_layernorm.weight", NULL, NULL);
        s = add(tt, &cap, TR_Q, TK_DENSE, l, true, 2, Hq * D, H, 0);
        name_layer(s, l, "self_attn.q_proj.weight", NULL, NULL);
        s = add(tt, &cap, TR_K, TK_DENSE, l, true, 2, Hkv * D, H, 0);
        name_layer(s, l, "self_attn.k_proj.weight", NULL, NULL);
        s = add(tt, &cap, TR_V, TK_DENSE, l, true, 2, Hkv * D, H, 0);
        name_layer(s, l, "self_attn.v_proj.weight", NULL, NULL);
        s = add(tt, &cap, TR_O, TK_DENSE, l, true, 2, H, Hq * D, 0);
        name_layer(s, l, "self_attn.o_proj.weight", NULL, NULL);
        s = add(tt, &cap, TR_QNORM, TK_NORM, l, false, 1, D, 0, 0);
        name_layer(s, l, "self_attn.q_norm.weight", NULL, NULL);
        s = add(tt, &cap, TR_KNORM, TK_NORM, l, false, 1, D, 0, 0);
        name_layer(s, l, "self_attn.k_norm.weight", NULL, NULL);
        s = add(tt, &cap, TR_MLP_NORM, TK_NORM, l, false, 1, H, 0, 0);
        name_layer(s, l, "post_attention_layernorm.weight", NULL, NULL);
        if (config_layer_is_moe(m, l)) {
            s = add(tt, &cap, TR_ROUTER, TK_ROUTER, l, router_decay, 2, E, H, 0);
            name_layer(s, l, "mlp.gate.weight", NULL, NULL);
            s->frozen = router_frozen;
            /* gate rows first, then up rows: transformers 5.x's fused layout */
            s = add(tt, &cap, TR_EXP_GATE_UP, TK_EXPERT, l, true, 3, E, 2 * I, H);
            name_layer(s, l, "mlp.experts.gate_up_proj", "mlp.experts.%d.gate_proj.weight",
                       "mlp.experts.%d.up_proj.weight");
            s = add(tt, &cap, TR_EXP_DOWN, TK_EXPERT, l, true, 3, E, H, I);
            name_layer(s, l, "mlp.experts.down_proj", "mlp.experts.%d.down_proj.weight", NULL);
        } else {
            s = add(tt, &cap, TR_MLP_GATE_UP, TK_DENSE, l, true, 2, 2 * Id, H, 0);
            name_layer(s, l, "mlp.gate_up_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight");
            s = add(tt, &cap, TR_MLP_DOWN, TK_DENSE, l, true, 2, H, Id, 0);
            name_layer(s, l, "mlp.down_proj.weight", NULL, NULL);
        }
    }
    s = add(tt, &cap, TR_FINAL_NORM, TK_NORM, -1, false, 1, H, 0, 0);
    name_global(s, "model.norm.weight");
    if (!m->tie_word_embeddings) {
        s = add(tt, &cap, TR_LM_HEAD, TK_DENSE, -1, true, 2, V, H, 0);
        name_global(s, "lm_head.weight");
    }

    tt->by_role = mt_malloc((size_t)(L + 1) * TR_COUNT * sizeof(int));
    for (int i = 0; i < (L + 1) * TR_COUNT; i++) tt->by_role[i] = -1;
    for (int i = 0; i < tt->n; i++) {
        s = &tt->t[i];
        enum tensor_group g = tensor_group_of(s);
        s->offset = tt->group_numel[g];
        tt->group_numel[g] += s->numel;
        int row = s->layer < 0 ? L : s->layer;
        tt->by_role[row * TR_COUNT + s->role] = i;
    }
}

void tensor_table_free(struct tensor_table *tt)
{
    free(tt->t);
    free(tt->by_role);
    memset(tt, 0, sizeof *tt);
}

int tensor_lookup(const struct tensor_table *tt, enum tensor_role role, int layer)
{
    if (layer >= tt->n_layers || layer < -1) return -1;
    int row = layer < 0 ? tt->n_layers : layer;
    return tt->by_role[row * TR_COUNT + role];
}

int tensor_find(const struct tensor_table *tt, const char *name)
{
    for (int i = 0; i < tt->n; i++)
        if (strcmp(tt->t[i].name, name) == 0) return i;
    return -1;
}

static void split_rows(int64_t rows, int parts, int part, struct tensor_shard *o)
{
    int64_t per = MT_CEIL_DIV(rows, parts);
    int64_t r0 = per * part;
    if (r0 > rows) r0 = rows;
    int64_t r1 = r0 + per > rows ? rows : r0 + per;
    o->r0 = r0;
    o->nr = r1 - r0;
    o->padded_rows = per;
}

void tensor_shard_of(const struct tensor_spec *s, int ep, int ep_rank, int ep_fsdp, int fsdp_rank,
                     int stage_size, int stage_rank, struct tensor_shard *o)
{
    memset(o, 0, sizeof *o);
    if (s->kind == TK_EXPERT) {
        o->ne = s->shape[0] / ep;
        o->e0 = o->ne * ep_rank;
        split_rows(s->shape[1], ep_fsdp, fsdp_rank, o);
        o->row_elems = s->shape[2];
        o->numel_padded = o->ne * o->padded_rows * o->row_elems;
    } else {
        o->e0 = 0;
        o->ne = 1;
        split_rows(s->shape[0], stage_size, stage_rank, o);
        o->row_elems = s->ndim > 1 ? s->numel / s->shape[0] : 1;
        o->numel_padded = o->padded_rows * o->row_elems;
    }
}
