/* Memory estimate per stage, as src/params.c, src/fsdp.c and src/model.c allocate it:
 *  - the shard (params.h): fp32 master weights, fp32 gradient and Adam moments (fp32 or bf16) for
 *    the rank's piece of every unit of the stage (non-expert units split in S equal chunks, expert
 *    tensors dim 0 across EP and dim 1 across EP_FSDP, padded), plus its compute-dtype copy when
 *    train.weight_copy keeps one (none needed with fp32 compute: the copy is the master);
 *  - working weights (fsdp.c): a group of one with a copy computes from it in place; any other
 *    group builds units in working buffers: one of the largest unit and one of the largest layer
 *    (parallel.reshard_after_forward), or one per unit of the stage;
 *  - working gradients: groups of several ranks accumulate a unit's gradient in a buffer of the
 *    largest unit (two with tied embeddings) before the reduce-scatter into the shard;
 *  - buffers: the expert all-gather / reduce-scatter staging (group x piece, fp32; the collectives
 *    run in place), the backward scratch of the model (model.c, moe.c) and, with
 *    ep > 1, the all-to-all send rows and receive window;
 *  - the embedding lives on stage 0, final norm and lm_head on the last stage; with tied embeddings
 *    and pp > 1 the last stage keeps its own copy of the embedding for the head. */
#include "memory_estimate.h"
#include "stash_place.h"

#include "attention_parts.h"
#include "env_flag.h"

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

/* The largest layer's full activations among [layer0, layer1) (what the recompute rebuilds). */
static double largest_layer_bytes(const struct config *c, int layer0, int layer1)
{
    const double T = (double)c->train.micro_batch_size * (double)c->train.seq_len;
    const double act_b = c->model.precision == MT_PREC_FP32 ? 4 : 2;
    double largest = 0;
    for (int l = layer0; l < layer1; l++) {
        double b = layer_activation_bytes(&c->model, l, T, act_b, c->parallel.expert_parallel_size);
        largest = b > largest ? b : largest;
    }
    return largest;
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

/* Backward scratch of model.c / moe.c for one micro-batch: the residual gradient and three wide
 * temporaries, q/k/v gradients, the router's compute-dtype logits and top-k weight gradients, the
 * expert-side gradient rows (as x_exp, gu, act, y_exp: headroom x T x k rows), and with ep > 1 the
 * sender's pair rows with their metadata and the all-to-all receive window (comm_ipc / NCCL inbox:
 * the rows a rank receives, 25% headroom), with the deferred o/q_proj gradients' copies. The
 * attention backward's dS tiles where the logits cannot hold them. MT_MOE_LOOPBACK (a benchmarking
 * switch) is not counted. */
static double scratch_bytes(const struct config *c, bool last)
{
    const struct model_config *m = &c->model;
    const double T = (double)c->train.micro_batch_size * (double)c->train.seq_len;
    const double act_b = m->precision == MT_PREC_FP32 ? 4 : 2;
    const double H = m->hidden_size, D = config_head_dim(m), Hq = m->num_attention_heads;
    const double Hkv = m->num_key_value_heads, wide = H > Hq * D ? H : Hq * D;
    const double E = m->num_experts, k = m->num_experts_per_tok, I = m->moe_intermediate_size;
    const int ep = c->parallel.expert_parallel_size;
    double b = T * (H + 3 * wide + (Hq + 2 * Hkv) * D) * act_b;
    b += T * (2 * (double)m->intermediate_size + m->intermediate_size) * act_b;
    if (E > 0) {
        /* the fixed exchange (model.h fixed_exchange) sends every rank a block of T pairs */
        const bool fixed = config_moe_fixed_exchange(c);
        const double headroom = ep > 1 ? 1.25 : 1.0, pairs = T * (k < ep && !fixed ? k : ep);
        /* the fixed exchange's pair sums need ep·T rows of the expert-side scratch where that is more
         * (its gu and act are as wide as the rows it holds) */
        const double exp_rows = fixed && ep > 1 && ep > headroom * k ? T * ep : headroom * T * k;
        b += T * E * act_b + T * k * 4 + exp_rows * (2 * H + 3 * I) * act_b;
        if (ep > 1) b += pairs * (H * act_b + 8 * k) + 1.25 * pairs * H * act_b + pairs * 1.25 * k * 4;
        /* parallel.moe_chunks > 1 (moe_exchange.c) receives into its own window instead of the
         * inbox (the same size) and adds one for the routing-weight gradients coming home */
        if (ep > 1 && c->parallel.moe_chunks > 1) b += 1.25 * pairs * k * 4;
        /* the deferred o_proj and q_proj weight gradients' output gradients (model_enable_deferred_wgrads:
         * where gradients stay put over the step and activations are not recomputed) */
        if (ep > 1 && !c->train.activation_checkpointing && c->parallel.reduce_grads != MT_REDUCE_MICRO_STEP)
            b += T * (H + Hq * D) * act_b;
    }
    /* the bf16 attention backward keeps its dS tiles (64 x 64 of the causal lower triangle of each
     * sequence and query head), then its dK/dV parts' sums (attention_parts.h), in the logits on
     * the last stage where they fit, elsewhere in buffers of their own (cuda/attention_tc_bwd.cu) */
    if (m->precision != MT_PREC_FP32 && (D == 64 || D == 128)) {
        const long long mb = c->train.micro_batch_size, S = c->train.seq_len;
        const double nt = (double)((S + 63) / 64);
        const double ds = (double)mb * Hq * nt * (nt + 1) / 2 * 64 * 64 * 2;
        const int parts = attn_dkdv_parts(mb, S, (int)Hq, (int)Hkv);
        const double sums = attn_dkdv_part_bytes(mb, S, (int)Hkv, (int)D, parts);
        double lent = last ? T * (double)m->vocab_size * act_b : 0;
        if (ds <= lent) lent -= ds;
        else b += ds;
        if (sums > lent) b += sums;
    }
    return b;
}

/* parallel.expert_wgrad_pairs (model.h struct expert_wgrad_stash): one MoE layer's parked expert
 * rows of a micro-step (a pairing layer parks one, a layer grouping g micro-steps g - 1): inputs
 * (x_exp H, act I) and output gradients (d_gu 2I, d_y_exp H) of `rows` times the mean rows T x k */
static double wgrad_stash_bytes(const struct config *c, double rows)
{
    const struct model_config *m = &c->model;
    const double T = (double)c->train.micro_batch_size * (double)c->train.seq_len;
    const double act_b = m->precision == MT_PREC_FP32 ? 4 : 2;
    return rows * T * m->num_experts_per_tok * (2.0 * m->hidden_size + 3.0 * m->moe_intermediate_size) * act_b;
}

static int micro_steps(const struct config *c, const struct mesh_dims *d)
{
    const int dp_micro = d->S * c->train.micro_batch_size;
    return dp_micro > 0 ? MT_MAX(1, c->train.global_batch_size / dp_micro) : 1;
}

/* MT_STASH_IN_GRADS (stash_place.h): the bytes of the stage's parked expert rows that lie in lower
 * layers' expert gradients, placed as model_place_expert_stash places them. host_numel[l]: layer
 * l's expert gradient elements on this rank. */
static double stash_in_grads_bytes(const struct config *c, const struct stage_estimate *e, const int64_t *host_numel,
                                   int n_micro, int ep)
{
    const struct model_config *m = &c->model;
    const int L = m->num_hidden_layers;
    struct stash_host *hosts = mt_calloc((size_t)MT_MAX(L, 1), sizeof *hosts);
    const int max_slots = MT_MAX(c->parallel.wgrad_group, MT_WGRAD_AUTO_GROUP_MAX); /* stash_layer_slots' most */
    struct stash_buf *bufs = mt_calloc((size_t)MT_MAX(L, 1) * max_slots * 4, sizeof *bufs);
    int64_t bytes[4];
    const int64_t T = (int64_t)c->train.micro_batch_size * c->train.seq_len;
    stash_slot_bytes(stash_slot_rows(T, m->num_experts_per_tok, ep), T, m->hidden_size, m->moe_intermediate_size,
                     m->intermediate_size, m->precision == MT_PREC_FP32 ? 4 : 2, bytes);
    int n_hosts = 0, n_bufs = 0;
    for (int l = e->layer0, n = 0; l < e->layer1; l++) {
        if (!config_layer_is_moe(m, l)) continue;
        const int slots = stash_layer_slots(n++, c->parallel.wgrad_pair_layers, c->parallel.wgrad_group_layers,
                                            c->parallel.wgrad_group, c->parallel.wgrad_big_layers,
                                            MT_WGRAD_AUTO_GROUP_MAX);
        if (slots > 0 && slots + 1 >= n_micro)
            hosts[n_hosts++] = (struct stash_host){l, stash_host_bytes(host_numel[l] * (int64_t)sizeof(float))};
        for (int k = 0; k < MT_MIN(slots, n_micro - 1); k++)
            for (int b = 0; b < 4; b++) bufs[n_bufs++] = (struct stash_buf){.layer = l, .bytes = bytes[b]};
    }
    const double placed = (double)stash_place(hosts, n_hosts, bufs, n_bufs);
    free(hosts);
    free(bufs);
    return placed;
}

void estimate_stage(const struct config *c, const struct tensor_table *tt, const struct mesh_dims *d,
                    int stage, bool keep_copy, struct stage_estimate *e)
{
    const struct model_config *m = &c->model;
    memset(e, 0, sizeof *e);
    e->stage = stage;
    mesh_stage_layers_cfg(c, d->pp, stage, &e->layer0, &e->layer1);
    e->has_embed = stage == 0;
    e->has_head = stage == d->pp - 1;
    for (int l = e->layer0; l < e->layer1; l++) e->n_moe_layers += config_layer_is_moe(m, l);

    /* per unit of the model (tensor_unit): dense working elements, expert working elements and the
     * expert piece of one rank */
    const int L = m->num_hidden_layers, n_units = L + 2;
    int64_t *wd = mt_calloc((size_t)n_units, sizeof *wd), *we = mt_calloc((size_t)n_units, sizeof *we);
    int64_t *pe = mt_calloc((size_t)n_units, sizeof *pe);
    const bool tied = m->tie_word_embeddings;
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (!on_stage(s, e, tied)) continue;
        int u = tensor_unit(s, L);
        struct tensor_shard sh;
        tensor_shard_of(s, d->ep, 0, d->ep_fsdp, 0, d->S, 0, &sh);
        if (s->kind == TK_EXPERT) {
            we[u] += sh.ne * s->shape[1] * s->shape[2];
            pe[u] += sh.numel_padded;
        } else {
            wd[u] += s->numel;
        }
    }
    int64_t max_wd = 0, max_we = 0, max_pe = 0, all_wd = 0, all_we = 0, lay_wd = 0, lay_we = 0;
    for (int u = 0; u < n_units; u++) {
        int64_t pd = MT_CEIL_DIV(wd[u], d->S);
        e->dense_numel += pd;
        e->expert_numel += pe[u];
        e->work_numel += wd[u] + we[u];
        max_wd = MT_MAX(max_wd, pd * d->S);
        max_we = MT_MAX(max_we, we[u]);
        max_pe = MT_MAX(max_pe, pe[u]);
        all_wd += pd * d->S;
        all_we += we[u];
        if (u >= 1 && u <= L) {
            lay_wd = MT_MAX(lay_wd, pd * d->S);
            lay_we = MT_MAX(lay_we, we[u]);
        }
    }
    free(wd);
    free(we);

    const bool fp32 = m->precision == MT_PREC_FP32;
    const double x = fp32 ? 4 : 2;
    const double held = (double)(e->dense_numel + e->expert_numel);
    const bool split = c->train.master_weights == MT_MASTER_SPLIT;
    const bool copy = (keep_copy || split) && !fp32; /* a kept fp32 copy is the master itself */
    const bool reshard = c->parallel.reshard_after_forward != MT_TRI_FALSE; /* auto: until resolved */
    const bool dyn_wd = !(d->S == 1 && keep_copy), dyn_we = !(d->ep_fsdp == 1 && keep_copy);
    const int n_gbufs = tied ? 2 : 1;
    double work_w = 0, work_g = 0, staging = 0;
    /* fsdp.c: one buffer for the largest unit, one for the largest layer; collectives in place */
    if (dyn_wd) work_w += (reshard ? (double)(max_wd + lay_wd) : (double)all_wd) * x;
    if (dyn_we) work_w += (reshard ? (double)(max_we + lay_we) : (double)all_we) * x;
    /* with prefetch, one more dense buffer of the largest layer for the overlapped reduce-scatter;
     * reduce_grads=step: every unit's own buffer instead */
    const bool per_step = c->parallel.reduce_grads == MT_REDUCE_STEP;
    if (d->S > 1)
        work_g += (per_step ? (double)all_wd : n_gbufs * (double)max_wd + (c->parallel.prefetch ? (double)lay_wd : 0)) * 4;
    if (d->ep_fsdp > 1) {
        work_g += (per_step ? (double)all_we : n_gbufs * (double)max_we) * 4;
        staging += (double)d->ep_fsdp * max_pe * 4;
    }
    e->param_bytes = (copy ? held * x : 0) + work_w;
    e->grad_bytes = held * 4 + work_g;
    e->master_bytes = held * (split ? 2 : 4); /* split: the low halves; the high halves are the copy */
    e->adam_bytes = held * (c->train.optimizer_state_dtype == MT_STATE_BF16 ? 4 : 8);
    /* 1F1B (pipeline.c): stage s keeps min(pp - s, micro-steps) micro-batches in flight, each with
     * its layers' saved activations (the recompute's shared layer and the head once), its input
     * and output rows and, between stages, its transfer buffers for dL/dh in and out */
    const int n_micro = micro_steps(c, d);
    e->slots = d->pp > 1 ? MT_MIN(d->pp - stage, n_micro) : 1;
    const double T = (double)c->train.micro_batch_size * (double)c->train.seq_len;
    const double once = estimate_activation_bytes(c, e->layer0, e->layer0, e->has_embed, e->has_head);
    const double per_slot = estimate_activation_bytes(c, e->layer0, e->layer1, false, false) -
                            (c->train.activation_checkpointing ? largest_layer_bytes(c, e->layer0, e->layer1) : 0);
    const double rows = (e->has_head ? 0 : T * m->hidden_size * x) + T * 12;  /* h_out; ids, labels, positions */
    e->act_bytes = once + e->slots * (per_slot + rows) +
                   (c->train.activation_checkpointing ? largest_layer_bytes(c, e->layer0, e->layer1) : 0);
    /* parallel.expert_wgrad_pairs (auto counts as off until resolved) and expert_wgrad_group */
    if (c->parallel.expert_wgrad_pairs == MT_TRI_TRUE && n_micro > 1) {
        const int paired = MT_MIN(e->n_moe_layers, c->parallel.wgrad_pair_layers);
        const int grouped = MT_MIN(paired, c->parallel.wgrad_group_layers);
        const int g = MT_MIN(MT_MAX(c->parallel.wgrad_group, 2), n_micro); /* a step's micro-steps at most */
        /* the first wgrad_big_layers of the grouping layers take groups of MT_WGRAD_AUTO_GROUP_MAX */
        const int big = MT_MIN(grouped, c->parallel.wgrad_big_layers);
        const int gb = MT_MAX(MT_MIN(MT_WGRAD_AUTO_GROUP_MAX, n_micro) - g, 0);
        /* parallel.expert_wgrad_jobs: a job holds the last micro-step's rows too, in one more slot */
        const int jobs = c->parallel.expert_wgrad_jobs && d->ep > 1 && n_micro > 2 ? paired : 0;
        /* with EP the rows a rank receives vary: the pair's stash at the buffers' 25% headroom, and
         * each micro-step a group parks beyond it at the most a rank can receive, every EP rank's
         * T x k pairs (ep x the mean): a group multiplies the headroom's error (two H200s, EP=2,
         * groups of 4: acts 8% over a plan at 1.25 x, twentieth session) */
        const int ep = d->ep;
        e->act_bytes += (paired + jobs) * wgrad_stash_bytes(c, ep > 1 ? 1.25 : 1.0) +
                        (grouped * (g - 2) + big * gb) * wgrad_stash_bytes(c, ep);
        if (c->parallel.stash_in_grads) {
            int64_t *host_numel = mt_calloc((size_t)MT_MAX(L, 1), sizeof *host_numel);
            for (int l = 0; l < L; l++) host_numel[l] = pe[l + 1]; /* tensor_unit: layer l is unit 1 + l */
            e->stash_in_grads_bytes = stash_in_grads_bytes(c, e, host_numel, n_micro, ep);
            e->act_bytes -= e->stash_in_grads_bytes;
            free(host_numel);
        }
    }
    free(pe);
    const double transfer = d->pp > 1 ? (double)e->slots * ((e->has_head ? 0 : 1) + (e->has_embed ? 0 : 1)) * T *
                                            m->hidden_size * x : 0;
    e->buffer_bytes = staging + scratch_bytes(c, e->has_head) + transfer;
    e->keep_copy = copy;
    e->total_bytes = e->param_bytes + e->grad_bytes + e->master_bytes + e->adam_bytes + e->act_bytes +
                     e->buffer_bytes;
}

double estimate_peak_bytes(const struct config *c, const struct mesh_dims *d, bool keep_copy)
{
    struct tensor_table tt;
    tensor_table_build(&tt, &c->model);
    double peak = 0;
    for (int s = 0; s < d->pp; s++) {
        struct stage_estimate e;
        estimate_stage(c, &tt, d, s, keep_copy, &e);
        peak = MT_MAX(peak, e.total_bytes);
    }
    tensor_table_free(&tt);
    return peak;
}

enum mt_reduce_grads estimate_reduce_grads(const struct config *c, const struct mesh_dims *d, bool keep_copy,
                                           double device_bytes)
{
    if (c->parallel.reduce_grads != MT_REDUCE_AUTO) return c->parallel.reduce_grads;
    if (device_bytes <= 0) return MT_REDUCE_MICRO_STEP;
    struct config *t = mt_malloc(sizeof *t);
    *t = *c;
    t->parallel.reduce_grads = MT_REDUCE_STEP;
    const bool fits = estimate_peak_bytes(t, d, keep_copy) <= MT_AUTO_MEM_SHARE * device_bytes;
    free(t);
    return fits ? MT_REDUCE_STEP : MT_REDUCE_MICRO_STEP;
}

bool estimate_reshard(const struct config *c, const struct mesh_dims *d, bool keep_copy, double device_bytes)
{
    if (c->parallel.reshard_after_forward != MT_TRI_AUTO) return c->parallel.reshard_after_forward == MT_TRI_TRUE;
    if (device_bytes <= 0) return true;
    struct config *t = mt_malloc(sizeof *t);
    *t = *c;
    t->parallel.reshard_after_forward = MT_TRI_FALSE;
    const bool fits = estimate_peak_bytes(t, d, keep_copy) <= MT_AUTO_MEM_SHARE * device_bytes;
    free(t);
    return !fits;
}

bool estimate_keep_copy(const struct config *c, const struct mesh_dims *d, double device_bytes)
{
    if (c->train.weight_copy != MT_COPY_AUTO) return c->train.weight_copy == MT_COPY_KEEP;
    if (c->model.precision == MT_PREC_FP32 || device_bytes <= 0) return true;
    if (c->train.master_weights == MT_MASTER_SPLIT) return true; /* the copy is the master's high half */
    /* a group of one computes from the kept copy in place, while casting needs working buffers of
     * the largest unit and layer: with a huge embedding the copy can be the smaller of the two */
    const double keep = estimate_peak_bytes(c, d, true);
    return keep <= MT_AUTO_MEM_SHARE * device_bytes || keep <= estimate_peak_bytes(c, d, false);
}

int estimate_expert_wgrad_pair_layers(const struct config *c, const struct mesh_dims *d, bool keep_copy,
                                      double device_bytes)
{
    if (c->parallel.expert_wgrad_pairs != MT_TRI_AUTO)
        return c->parallel.expert_wgrad_pairs == MT_TRI_TRUE ? c->parallel.wgrad_pair_layers : 0;
    if (device_bytes <= 0 || c->model.precision == MT_PREC_FP32 || c->model.num_experts == 0 ||
        c->parallel.moe_chunks > 1 || micro_steps(c, d) < 2 || !estimate_expert_grads_kept(c, d))
        return 0;
    struct config *t = mt_malloc(sizeof *t);
    *t = *c;
    t->parallel.expert_wgrad_pairs = MT_TRI_TRUE;
    /* a group set by hand applies to every pairing layer; auto counts pairs here */
    t->parallel.wgrad_group = c->parallel.expert_wgrad_group >= 2 ? c->parallel.expert_wgrad_group : 2;
    t->parallel.wgrad_group_layers = c->parallel.expert_wgrad_group >= 2 ? MT_MAX_LAYERS : 0;
    /* one more layer at a time: each adds the same stash to every stage that has it */
    int n = 0;
    for (int k = 1; k <= c->model.num_hidden_layers; k++) {
        t->parallel.wgrad_pair_layers = k;
        if (estimate_peak_bytes(t, d, keep_copy) > MT_PAIRS_MEM_SHARE * device_bytes) break;
        n = k;
    }
    free(t);
    return n == c->model.num_hidden_layers ? MT_MAX_LAYERS : n;
}

/* MT_STASH_IN_GRADS: 0 off, 1 on (any backend: tests), auto (the default) on a GPU; only where the
 * model parks in place (model_place_expert_stash): each rank holds whole experts and their
 * gradients (EP_FSDP 1), no pipeline, no recompute, moe_chunks 1, no loopback pairs. With it,
 * every layer of the bench config takes groups of eight on an H200 (124.8 GiB planned instead of
 * 130.7 with 5 of 8): -0.86% a step at seq 1024 x 8, -0.42% at the bench shape, docs/benchmarks.md,
 * fifty-eighth session. With expert parallelism only with the fixed exchange (its capacity sizes
 * the rows) and no expert wgrad jobs (a job runs past the lower layers' gradients): the bench
 * config at EP=2 on two H200s, 124.0 GiB peak instead of 126.1, eights in 7 layers instead of 6,
 * the step 0.27% shorter (3 runs each, within the noise; sixtieth session). */
static bool stash_in_grads_applies(const struct config *c, const struct mesh_dims *d, double device_bytes)
{
    static const char *const vals[] = {"0", "1", "auto"};
    const int mode = mt_env_choice("MT_STASH_IN_GRADS", vals, 3, 2);
    const bool ep_ok = d->ep == 1 || (config_moe_fixed_exchange(c) && !c->parallel.expert_wgrad_jobs);
    return (mode == 1 || (mode == 2 && device_bytes > 0)) && ep_ok && d->ep_fsdp == 1 && d->pp == 1 &&
           !c->train.activation_checkpointing && c->parallel.moe_chunks == 1 && !mt_env_flag("MT_MOE_LOOPBACK");
}

void estimate_resolve_expert_wgrad_pairs(struct config *c, const struct mesh_dims *d, bool keep_copy,
                                         double device_bytes)
{
    c->parallel.stash_in_grads = stash_in_grads_applies(c, d, device_bytes);
    const int n = estimate_expert_wgrad_pair_layers(c, d, keep_copy, device_bytes);
    c->parallel.expert_wgrad_pairs = n > 0 ? MT_TRI_TRUE : MT_TRI_FALSE;
    c->parallel.wgrad_pair_layers = n > 0 ? n : MT_MAX_LAYERS;
    if (c->parallel.expert_wgrad_group >= 2) { /* by hand: every pairing layer */
        c->parallel.wgrad_group = c->parallel.expert_wgrad_group;
        c->parallel.wgrad_group_layers = n > 0 ? MT_MAX_LAYERS : 0;
        return;
    }
    /* auto: once every layer pairs, groups of MT_WGRAD_AUTO_GROUP in as many of them (each
     * stage's first ones) as keep the peak within MT_GROUP_MEM_SHARE. A pair halves a layer's dw
     * traffic for one parked micro-step; a group of 4 halves it again for two more, so pairs
     * everywhere come first. With EP the rows a rank receives vary (two H200s, EP=2, groups of 4
     * in 8 layers: acts 43.5 GiB measured, 36.4 planned when groups were planned at 1.25 x the
     * mean), so each micro-step parked beyond the pair is planned at the bound, ep x the mean (the
     * bench shape at EP=2 on two H200s: 120.9 GiB measured, the step 0.94% shorter than pairs
     * alone, docs/benchmarks.md, fifty-fourth session). MT_WGRAD_GROUP_EP=0: pairs only with EP. */
    c->parallel.wgrad_group = MT_WGRAD_AUTO_GROUP;
    c->parallel.wgrad_group_layers = 0;
    c->parallel.wgrad_big_layers = 0;
    /* MT_GROUP_MEM_SHARE: another share, for measuring what more groups of eight are worth */
    const double group_share = mt_env_positive("MT_GROUP_MEM_SHARE", MT_GROUP_MEM_SHARE);
    if (group_share >= 1) mt_user_error("MT_GROUP_MEM_SHARE=%g: a share of the device's memory, under 1", group_share);
    static const char *const off_on[] = {"0", "1"};
    const bool ep_ok = d->ep == 1 || mt_env_choice("MT_WGRAD_GROUP_EP", off_on, 2, 1);
    if (n != MT_MAX_LAYERS || device_bytes <= 0 || micro_steps(c, d) < 3 || !ep_ok) return;
    int k_fit = 0;
    for (int k = 1; k <= c->model.num_hidden_layers; k++) {
        c->parallel.wgrad_group_layers = k;
        if (estimate_peak_bytes(c, d, keep_copy) > group_share * device_bytes) break;
        k_fit = k;
    }
    c->parallel.wgrad_group_layers = k_fit == c->model.num_hidden_layers ? MT_MAX_LAYERS : k_fit;
    /* every layer groups 4: groups of MT_WGRAD_AUTO_GROUP_MAX where they fit in every layer (a
     * Qwen3-235B-A22B layer at micro-batch 1 moves 19 GB of fp32 dw a group, ~5.5 ms on an H200
     * of ~14, docs/benchmarks.md), with more micro-steps than 4 */
    if (c->parallel.wgrad_group_layers != MT_MAX_LAYERS || micro_steps(c, d) <= MT_WGRAD_AUTO_GROUP) return;
    c->parallel.wgrad_group = MT_WGRAD_AUTO_GROUP_MAX;
    if (estimate_peak_bytes(c, d, keep_copy) <= group_share * device_bytes) return;
    c->parallel.wgrad_group = MT_WGRAD_AUTO_GROUP;
    /* groups of MT_WGRAD_AUTO_GROUP_MAX in as many of the first layers as fit, four in the rest
     * (bench_grouped_gemm: a layer's eight micro-steps as one call instead of two ~0.8 ms shorter;
     * with the split master's freed memory 3 of the bench's 8 layers, -0.3 to -0.4% a step on one
     * H200 at both bench shapes, docs/benchmarks.md, fifty-third session). MT_WGRAD_GROUP_MIX=0:
     * fours everywhere, as before. */
    if (!mt_env_choice("MT_WGRAD_GROUP_MIX", off_on, 2, 1)) return;
    int k_big = 0;
    for (int k = 1; k < c->model.num_hidden_layers; k++) {
        c->parallel.wgrad_big_layers = k;
        if (estimate_peak_bytes(c, d, keep_copy) > group_share * device_bytes) break;
        k_big = k;
    }
    c->parallel.wgrad_big_layers = k_big;
}

bool estimate_expert_grads_kept(const struct config *c, const struct mesh_dims *d)
{
    return d->ep_fsdp == 1 || c->parallel.reduce_grads == MT_REDUCE_STEP;
}
