/* The tensor spec table: every parameter of the model described once. Buffers, sharding, checkpoint
 * dataset names, the Hugging Face name mapping and the memory estimate all derive from it; no code
 * special-cases a tensor by its index. */
#ifndef MT_TENSORS_H
#define MT_TENSORS_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"

enum tensor_kind {
    TK_EXPERT,     /* [E, d1, d2]: dim 0 split across EP, dim 1 across EP_FSDP */
    TK_DENSE,      /* matrices (attention, dense MLP, embedding, lm_head): dim 0 split across the stage */
    TK_NORM,       /* RMSNorm weights */
    TK_ROUTER,     /* router gate [E, H] */
};

enum tensor_role {
    TR_EMBED, TR_ATTN_NORM, TR_Q, TR_K, TR_V, TR_O, TR_QNORM, TR_KNORM, TR_MLP_NORM,
    TR_ROUTER, TR_EXP_GATE_UP, TR_EXP_DOWN, TR_MLP_GATE_UP, TR_MLP_DOWN,
    TR_FINAL_NORM, TR_LM_HEAD, TR_COUNT
};

struct tensor_spec {
    char name[112];       /* stable name (HF in-memory style); checkpoint dataset name */
    /* Hub safetensors names. A fused tensor (gate_up) comes from n_hf hub tensors, part p holding the
     * p-th equal chunk of the rows (dim 1 of each expert for TK_EXPERT, dim 0 otherwise). For
     * TK_EXPERT each name is a format with one %d for the expert index. */
    char hf_name[2][112];
    int n_hf;
    enum tensor_role role;
    enum tensor_kind kind;
    int layer;            /* -1 for embedding, final norm, lm_head */
    int ndim;
    int64_t shape[3];     /* global shape, PyTorch layout (Linear weights are [out, in]) */
    int64_t numel;
    bool decay;           /* AdamW weight decay applies */
    bool frozen;          /* no update (freeze_router) */
    int64_t offset;       /* element offset inside its group's full (unsharded) flat buffer */
};

/* Expert tensors and the rest live in separate flat buffers: they reduce over different groups. */
enum tensor_group { TG_DENSE = 0, TG_EXPERT = 1, TG_COUNT = 2 };

struct tensor_table {
    int n;
    struct tensor_spec *t;          /* [n], ordered by layer (embedding first, lm_head last) */
    int64_t group_numel[TG_COUNT];  /* full (unsharded) size of each group's flat buffer */
    int *by_role;                   /* [(L + 1) * TR_COUNT]: index into t or -1; row L holds layer -1 */
    int n_layers;
};

static inline enum tensor_group tensor_group_of(const struct tensor_spec *s)
{
    return s->kind == TK_EXPERT ? TG_EXPERT : TG_DENSE;
}

/* FSDP unit of a tensor (design.md: one decoder layer per unit, the embedding and the final norm +
 * lm_head units of their own): 0 = embedding, 1 + l = layer l, n_layers + 1 = final norm and lm_head.
 * Unit order is table order. */
static inline int tensor_unit(const struct tensor_spec *s, int n_layers)
{
    return s->layer >= 0 ? 1 + s->layer : s->role == TR_EMBED ? 0 : n_layers + 1;
}

void tensor_table_build(struct tensor_table *tt, const struct model_config *m);
void tensor_table_free(struct tensor_table *tt);
/* Index of the tensor with this role in this layer (-1 for global ones), or -1 if absent. */
int tensor_lookup(const struct tensor_table *tt, enum tensor_role role, int layer);
/* Index of the tensor with this stable name, or -1. */
int tensor_find(const struct tensor_table *tt, const char *name);

/* Sharding of one tensor on one rank. For TK_EXPERT: experts [e0, e0 + ne) and rows [r0, r0 + nr)
 * of dim 1 (nr may be short on the last EP_FSDP rank; the shard is padded to ceil(d1 / fsdp) rows).
 * For the others: rows [r0, r0 + nr) of dim 0 out of a stage split into `stage_size` pieces. */
struct tensor_shard {
    int64_t e0, ne;       /* experts held (TK_EXPERT only; else 0, 1) */
    int64_t r0, nr;       /* rows of the split dimension actually held */
    int64_t padded_rows;  /* rows reserved in the buffer (same on every rank of the group) */
    int64_t row_elems;    /* elements per row of the split dimension */
    int64_t numel_padded; /* elements reserved for this shard */
};
void tensor_shard_of(const struct tensor_spec *s, int ep, int ep_rank, int ep_fsdp, int fsdp_rank,
                     int stage_size, int stage_rank, struct tensor_shard *out);

#endif
