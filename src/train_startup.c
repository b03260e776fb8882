#include "train_startup.h"

#include <math.h>
#include <stdio.h>

#include "common.h"
#include "memory_estimate.h"
#include "router_opts.h"

void train_print_startup(const struct config *c, const struct mesh *mesh, const struct backend *be,
                         const struct data_source *data, int n_micro, const struct model *m,
                         const char *init, bool keep_copy)
{
    if (mt_rank() != 0) return;
    const struct model_config *mc = &c->model;
    double n_total = 0;
    for (int i = 0; i < m->tt.n; i++) n_total += (double)m->tt.t[i].numel;
    printf("moetrain train %s\n", c->path);
    printf("  backend     %s (%s)\n", be->name,
           be->x_size == 4 ? "fp32 compute"
           : c->train.master_weights == MT_MASTER_SPLIT
               ? "bf16 compute, fp32 master weights held as the bf16 copy + a 16-bit low half"
               : "bf16 compute, fp32 master weights");
    printf("  model       %d layers, hidden %d, %d/%d heads of %d, %d experts top-%d (width %d), "
           "vocab %d, %.3gM parameters\n",
           mc->num_hidden_layers, mc->hidden_size, mc->num_attention_heads, mc->num_key_value_heads,
           config_head_dim(mc), mc->num_experts, mc->num_experts_per_tok, mc->moe_intermediate_size,
           mc->vocab_size, n_total / 1e6);
    printf("  mesh        %d ranks = pp %d x ep %d x ep_fsdp %d%s on %d node(s)\n", mesh->d.world,
           mesh->d.pp, mesh->d.ep, mesh->d.ep_fsdp, mesh->d.ep_outside ? " (ep_outside)" : "",
           mesh->n_nodes);
    if (mesh->d.S > 1)   /* what the FSDP options (and their auto settings) came to */
        printf("  sharding    non-expert weights over %d ranks%s; %s; layers %s; gradients reduce-scattered %s\n",
               mesh->d.S, mesh->d.ep_fsdp > 1 ? ", experts over ep_fsdp" : "",
               be->x_size == 4 ? "fp32 compute from the master"
               : keep_copy     ? "bf16 copy of the shard kept"
                               : "gathers cast from the fp32 master",
               c->parallel.reshard_after_forward != MT_TRI_FALSE ? "gathered per use" : "kept gathered over the step",
               c->parallel.reduce_grads == MT_REDUCE_STEP ? "once a step" : "every micro-step");
    int stage_moe = 0;
    for (int l = m->st.layer0; l < m->st.layer1; l++) stage_moe += config_layer_is_moe(mc, l);
    if (c->parallel.expert_wgrad_pairs == MT_TRI_TRUE && n_micro > 1 && stage_moe > 0) {
        const int n = MT_MIN(c->parallel.wgrad_pair_layers, stage_moe);
        const int g = MT_MIN(c->parallel.wgrad_group, n_micro);
        const int ng = g > 2 ? MT_MIN(c->parallel.wgrad_group_layers, n) : 0;
        char what[200];
        const int nb = ng ? MT_MIN(c->parallel.wgrad_big_layers, ng) : 0;
        if (nb > 0)
            snprintf(what, sizeof what, "%d micro-steps in one GEMM in the first %d MoE layers of each stage, %d in "
                     "the next %d%s", MT_MIN(MT_WGRAD_AUTO_GROUP_MAX, n_micro), nb, g, ng - nb,
                     ng < n ? ", two in the rest" : "");
        else if (ng > 0 && ng < n)
            snprintf(what, sizeof what, "%d micro-steps in one GEMM in the first %d MoE layers of each stage, of two in "
                     "the next %d", g, ng, n - ng);
        else if (n < stage_moe)
            snprintf(what, sizeof what, "%d micro-steps in one GEMM in the first %d MoE layers of each stage",
                     ng ? g : 2, n);
        else
            snprintf(what, sizeof what, "%d micro-steps in one GEMM", ng ? g : 2);
        /* under auto, within the memory (each stage's first layers) */
        const bool fits = n < stage_moe || (ng < n && c->parallel.expert_wgrad_group == 0 && ng > 0);
        printf("  experts     weight gradients of %s (parallel.expert_wgrad_pairs%s%s)\n", what,
               ng ? ", expert_wgrad_group" : "", fits ? "; what fits" : "");
    }
    if (m->wgrad_jobs)
        printf("  overlap     grouped expert weight gradients wait as jobs for later exchanges' waits, the rest "
               "at the layer's next backward (parallel.expert_wgrad_jobs; one more parked micro-step a "
               "pairing layer)\n");
    if (m->fixed_exchange)
        printf("  exchange    MoE pairs in blocks of %d tokens a rank, expert rows held to %lld a layer: no host "
               "waits (a step that needs more runs again; parallel.moe_fixed_exchange)\n", m->T, (long long)m->rows_cap[m->st.layer0]);
    if (stage_moe > 0 && m->pairs && m->combine_self_last && m->moe_chunks == 1)
        printf("  overlap     forward combine: the other ranks' rows through the down projection first, this "
               "rank's own under their transfer; its backward: this rank's own rows first, the other ranks' "
               "under their transfer; the dispatch's own rows from this rank's memory "
               "(parallel.moe_combine_self_last)\n");
    if (m->o_wgrad_dout)
        printf("  overlap     o_proj and q_proj weight gradients deferred under the next MoE layer's backward "
               "exchanges, all micro-steps but the last (MT_NO_DEFERRED_WGRAD=1: off)\n");
    printf("  batch       %d sequences x %d tokens per step = %d micro-steps x %d ranks x %d\n",
           c->train.global_batch_size, c->train.seq_len, n_micro, mesh->d.S,
           c->train.micro_batch_size);
    const char *lb = c->train.load_balance == MT_LB_AUX ? "aux loss" :
                     c->train.load_balance == MT_LB_BIAS ? "aux-loss-free bias" : "none";
    if (c->train.load_balance == MT_LB_AUX && c->train.aux_loss_scope == MT_AUX_GLOBAL_BATCH)
        lb = "aux loss over the global batch (forward pre-pass)";
    printf("  optimizer   AdamW lr %.3g -> %.3g (warmup %d), wd %.3g, clip %.3g; balancing: %s\n",
           c->train.lr, c->train.min_lr, c->train.warmup_steps, c->train.weight_decay,
           c->train.grad_clip, lb);
    char nd[256];
    no_decay_describe(&m->tt, nd, sizeof nd);
    printf("  no decay    %s\n", nd);
    printf("  data        %s\n", data_describe(data));
    double h = data_entropy_rate(data);
    if (isfinite(h))
        printf("              best achievable loss ~ %.4f nats/token (the corpus entropy rate)\n", h);
    printf("  init        %s\n", init);
    fflush(stdout);
}
