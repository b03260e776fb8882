/* Memory estimate per stage, as src/params.c and src/model.c allocate it today:
 *  - the shard: fp32 master weights and Adam moments (m and v) for the rank's piece of every tensor
 *    (non-expert tensors split across the S ranks of the stage, expert tensors dim 0 across EP and
 *    dim 1 across EP_FSDP, padded to equal shards), plus, where the group has more than one rank,
 *    the shard's compute-dtype copy and its reduced fp32 gradient (a group of one uses the working
 *    buffers themselves);
 *  - the working set: every tensor of the stage's layers gathered once per step (the local experts
 *    whole along dim 1) in the compute dtype, with its fp32 gradient accumulated over micro-batches;
 *  - buffers: the all-gather receive (compute dtype) and reduce-scatter send (fp32) staging of each
 *    group with more than one rank (group size x shard);
 *  - the embedding lives on stage 0, final norm and lm_head on the last stage; with tied embeddings
 *    and pp > 1 the last stage keeps its own copy of the embedding for the head.
 * Gathering one layer at a time (design.md) would replace the working set by a layer's worth. */
#include "memory_estimate.h"

#include <stdlib.h>
#include <string.h>

void estimate_model_counts(const struct tensor_table *tt, const struct model_config *m,
                           struct model_counts *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        out->total += s->numel;
        if (s->kind == TK_EXPERT) {
            out->expert += s->numel;
            /* a token runs through top_k of the shape[0] experts */
            out->active += s->numel / s->shape[0] * m->num_experts_per_tok;
        } else {
            out->non_expert += s->numel;
            out->active += s->numel;
        }
    }
}

/* Does this stage hold tensor s? */
static bool on_stage(const struct tensor_spec *s, const struct stage_estimate *e, bool tied)
{
    if (s->layer >= 0) return s->layer >= e->layer0 && s->layer < e->layer1;
    if (s->role == TR_EMBED) return e->has_embed || (tied && e->has_head);
    return e->has_head;  /* final norm, lm_head */
}

/* Bytes of one layer's activations saved for backward, T tokens, act_b bytes per activation element.
 * Attention: layer input x, input-norm output and its 1/rms, q and k before QK-norm and their
 * per-head 1/rms, q and k after RoPE and v, attention output and its log-sum-exp per head (a fused
 * attention recomputes the probabilities, no T x T matrix is kept), the residual after attention,
 * post-attention-norm output and its 1/rms. MoE: router logits and probabilities (fp32, E per token),
 * top-k ids (int32) and weights (fp32), then for the T*k routed rows the expert input, the gate_up
 * output (2I), the SwiGLU output (I) and the expert output (H, needed for the routing weight's
 * gradient); with ep > 1 the rows a rank receives vary with the routing and src/moe.c sizes those
 * buffers with 25% headroom, which is counted. Dense MLP: gate_up output (2 Id) and SwiGLU output
 * (Id). */
static double layer_activation_bytes(const struct model_config *m, int layer, double T, double act_b,
                                     int ep)
{
    const double H = m->hidden_size, D = config_head_dim(m), Hq = m->num_attention_heads;
    const double Hkv = m->num_key_value_heads;
    double per_tok = H * act_b + H * act_b + 4            /* x, input norm out, 1/rms */
                     + (Hq + Hkv) * D * act_b + (Hq + Hkv) * 4   /* q, k pre QK-norm, 1/rms */
                     + (Hq + 2 * Hkv) * D * act_b         /* q, k after RoPE, v */
                     + Hq * D * act_b + Hq * 4            /* attention output, lse */
                     + H * act_b + H * act_b + 4;         /* residual, post-attn norm out, 1/rms */
    if (config_layer_is_moe(m, layer)) {
        const double E = m->num_experts, k = m->num_experts_per_tok, I = m->moe_intermediate_size;
        const double headroom = ep > 1 ? 1.25 : 1.0;
        per_tok += 2 * E * 4 + k * (4 + 4) + headroom * k * (H + 2 * I + I + H) * act_b;
    } else {
        const double Id = m->intermediate_size;
        per_tok += (2 * Id + Id) * act_b;
    }
    return T * per_tok;
}

double estimate_activation_bytes(const struct config *c, int layer0, int layer1, bool first, bool last)
{
    const struct model_config *m = &c->model;
    const double T = (double)c->train.micro_batch_size * (double)c->train.seq_len;
    const double act_b = m->precision == MT_PREC_FP32 ? 4 : 2;
    const double H = m->hidden_size, V = m->vocab_size;
    double bytes = 0, largest = 0;
    for (int l = layer0; l < layer1; l++) {
        double b = layer_activation_bytes(m, l, T, act_b, c->parallel.expert_parallel_size);
        largest = b > largest ? b : largest;
        bytes += b;
    }
    if (c->train.activation_checkpointing && layer1 > layer0) {
        /* only each layer's input is kept; one layer is recomputed in full during its backward */
        bytes = (double)(layer1 - layer0) * T * H * act_b + largest;
    }
    if (first) bytes += T * 4;  /* token ids */
    if (last) {
        /* final norm input, output and 1/rms; labels; the logits in the activation dtype (the loss
         * reads them in place and writes its gradient over them) with each row's loss and lse */
        bytes += T * (2 * H * act_b + 4 + 4 + 8) + T * V * act_b;
    }
    return bytes;
}

void estimate_stage(const struct config *c, const struct tensor_table *tt, const struct mesh_dims *d,
                    int stage, struct stage_estimate *e)
{
    const struct model_config *m = &c->model;
    memset(e, 0, sizeof *e);
    e->stage = stage;
    mesh_stage_layers(m->num_hidden_layers, d->pp, stage, &e->layer0, &e->layer1);
    e->has_embed = stage == 0;
    e->has_head = stage == d->pp - 1;
    for (int l = e->layer0; l < e->layer1; l++) e->n_moe_layers += config_layer_is_moe(m, l);

    /* Working set of one compute unit: a layer, the embedding, or final norm + lm_head. Unit index:
     * layer - layer0, then n for the embedding, n + 1 for the head. */
    const int n = e->layer1 - e->layer0;
    int64_t *unit = mt_calloc((size_t)n + 2, sizeof *unit);
    const bool tied = m->tie_word_embeddings;
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (!on_stage(s, e, tied)) continue;
        /* every rank of a stage reserves the same padded shard; rank (local 0, e 0, f 0) stands
         * for all of them */
        struct tensor_shard sh;
        tensor_shard_of(s, d->ep, 0, d->ep_fsdp, 0, d->S, 0, &sh);
        if (s->kind == TK_EXPERT) e->expert_numel += sh.numel_padded;
        else e->dense_numel += sh.numel_padded;
        int64_t gathered = s->kind == TK_EXPERT ? sh.ne * s->shape[1] * s->shape[2] : s->numel;
        if (s->layer >= 0) unit[s->layer - e->layer0] += gathered;
        else if (s->role == TR_EMBED && e->has_embed) unit[n] += gathered;
        else unit[n + 1] += gathered;  /* final norm, lm_head, tied embedding copy on the last stage */
    }
    for (int u = 0; u < n + 2; u++) e->work_numel += unit[u];
    free(unit);

    const bool fp32 = m->precision == MT_PREC_FP32;
    const double held = (double)(e->dense_numel + e->expert_numel);
    const double param_b = fp32 ? 4 : 2;
    /* shard elements that need their own copy / gradient / staging: groups of more than one rank */
    const double own = (d->S > 1 ? (double)e->dense_numel : 0) + (d->ep_fsdp > 1 ? (double)e->expert_numel : 0);
    const double staged = (d->S > 1 ? (double)d->S * e->dense_numel : 0) +
                          (d->ep_fsdp > 1 ? (double)d->ep_fsdp * e->expert_numel : 0);
    e->param_bytes = ((double)e->work_numel + own) * param_b;
    e->grad_bytes = ((double)e->work_numel + own) * 4;
    e->master_bytes = held * 4;
    e->adam_bytes = held * 8;
    e->act_bytes = estimate_activation_bytes(c, e->layer0, e->layer1, e->has_embed, e->has_head);
    e->buffer_bytes = staged * (param_b + 4);
    e->total_bytes = e->param_bytes + e->grad_bytes + e->master_bytes + e->adam_bytes + e->act_bytes +
                     e->buffer_bytes;
}
