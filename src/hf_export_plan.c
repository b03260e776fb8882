/* The shard plan of an export (hf_export.h): names, shapes and byte offsets of every hub tensor,
 * all in int64 / uint64, computed from the tensor table alone so that a 30B model can be planned
 * (and tested) without a byte of weights. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hf_export.h"
#include "hf_load.h"

static struct hf_plan_entry *push(struct hf_plan *p, int *cap)
{
    if (p->n == *cap) p->e = mt_realloc(p->e, (size_t)(*cap = *cap ? 2 * *cap : 256) * sizeof *p->e);
    struct hf_plan_entry *e = &p->e[p->n++];
    memset(e, 0, sizeof *e);
    return e;
}

void hf_plan_build(struct hf_plan *p, const struct tensor_table *tt, const struct model_config *mc,
                   bool bias_layers, enum st_dtype dtype, uint64_t max_shard_bytes)
{
    memset(p, 0, sizeof *p);
    if (max_shard_bytes == 0) max_shard_bytes = HF_EXPORT_SHARD_BYTES;
    int cap = 0;
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        const int64_t n_exp = s->kind == TK_EXPERT ? s->shape[0] : 1;
        const int64_t per_expert = s->numel / n_exp, part = per_expert / s->n_hf;
        for (int64_t x = 0; x < n_exp; x++)
            for (int h = 0; h < s->n_hf; h++) {
                struct hf_plan_entry *e = push(p, &cap);
                hf_hub_name(e->name, sizeof e->name, s, h, x);
                e->ndim = hf_hub_shape(s, e->shape);
                e->tensor = i;
                e->layer = s->layer;
                e->gstart = x * per_expert + h * part;
                e->numel = part;
                e->dtype = dtype;
            }
    }
    /* the bias steers top-k choice with fp32 scores: rounding it to bf16 would change routing */
    for (int l = 0; bias_layers && l < mc->num_hidden_layers; l++) {
        if (!config_layer_is_moe(mc, l)) continue;
        struct hf_plan_entry *e = push(p, &cap);
        snprintf(e->name, sizeof e->name, "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        e->tensor = -1;
        e->layer = l;
        e->ndim = 1;
        e->shape[0] = e->numel = mc->num_experts;
        e->gstart = (int64_t)l * mc->num_experts;
        e->dtype = ST_F32;
    }
    int shard_cap = 0;
    uint64_t used = 0;
    for (int k = 0; k < p->n; k++) {
        struct hf_plan_entry *e = &p->e[k];
        const uint64_t bytes = (uint64_t)e->numel * (uint64_t)st_dtype_size(e->dtype);
        if (p->n_shards == 0 || (used > 0 && used + bytes > max_shard_bytes)) {
            if (p->n_shards == shard_cap)
                p->shard_bytes = mt_realloc(p->shard_bytes, (size_t)(shard_cap = shard_cap ? 2 * shard_cap : 16) *
                                                                sizeof *p->shard_bytes);
            p->shard_bytes[p->n_shards++] = 0;
            used = 0;
        }
        e->shard = p->n_shards - 1;
        e->begin = used;
        e->end = used + bytes;
        used += bytes;
        p->shard_bytes[e->shard] = used;
        p->total_size += bytes;
    }
}

void hf_plan_free(struct hf_plan *p)
{
    free(p->e);
    free(p->shard_bytes);
    memset(p, 0, sizeof *p);
}

void hf_plan_shard_name(char *out, size_t cap, int k, int n_shards)
{
    if (n_shards == 1) snprintf(out, cap, "model.safetensors");
    else snprintf(out, cap, "model-%05d-of-%05d.safetensors", k + 1, n_shards);
}
