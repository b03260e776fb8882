/* One micro-batch through the stage: the forward (embedding, layers, head and loss) and the
 * backward, with the FSDP unit hooks around each unit (model_step.h). Calls down into the layer
 * passes (layer.h: attention_block.c, moe.c), which use the model's state (model.c). */
#include "model_step.h"

#include <stdlib.h>

#include "common.h"
#include "env_flag.h"
#include "layer.h"

static int weight_index(const struct model *m, enum tensor_role role, int layer)
{
    int i = tensor_lookup(&m->tt, role, layer);
    MT_CHECK(i >= 0, "model has no tensor for role %d in layer %d", (int)role, layer);
    return i;
}

/* lm_head, or the embedding when the two are tied */
static int head_index(const struct model *m)
{
    int i = tensor_lookup(&m->tt, TR_LM_HEAD, -1);
    return i >= 0 ? i : weight_index(m, TR_EMBED, -1);
}

enum hook_kind { HOOK_BEFORE_FWD, HOOK_AFTER_FWD, HOOK_BEFORE_BWD, HOOK_AFTER_BWD };

static void hook(const struct model *m, enum hook_kind k, int unit)
{
    const struct model_unit_hooks *h = &m->hooks;
    void (*fn)(void *, int) = k == HOOK_BEFORE_FWD ? h->before_forward : k == HOOK_AFTER_FWD ? h->after_forward :
                              k == HOOK_BEFORE_BWD ? h->before_backward : h->after_backward;
    if (fn) fn(h->ctx, unit);
}

/* The head uses the final norm's unit and, with tied embeddings, the embedding's unit too. */
static void head_hook(const struct model *m, enum hook_kind k)
{
    hook(m, k, m->L + 1);
    int u = tensor_unit(&m->tt.t[head_index(m)], m->L);
    if (u != m->L + 1) hook(m, k, u);
}


/* Targets from labels (position t predicts labels[t + 1] of its sequence); returns the labelled
 * count. Ids are checked where they are used. */
static int64_t upload_batch(struct model *m, const int32_t *ids_host, const int32_t *labels_host)
{
    const struct backend *be = m->be;
    const int T = m->T, S = m->S, V = m->V;
    const int32_t *labels = labels_host ? labels_host : ids_host;
    int64_t n_valid = 0;
    if (m->st.first) {
        for (int t = 0; t < T; t++)
            MT_CHECK(ids_host[t] >= 0 && ids_host[t] < V, "token id %d out of range [0, %d)", ids_host[t], V);
        be->upload(m->ids, ids_host, (size_t)T * sizeof(int32_t));
    }
    if (m->st.last) {
        int32_t *targets = mt_malloc((size_t)T * sizeof(int32_t));
        for (int t = 0; t < T; t++) {
            bool last = (t % S) == S - 1;
            targets[t] = last ? MT_IGNORE_INDEX : labels[t + 1];
            if (targets[t] != MT_IGNORE_INDEX) {
                MT_CHECK(targets[t] >= 0 && targets[t] < V, "label %d out of range [0, %d)", targets[t], V);
                n_valid++;
            }
        }
        be->upload(m->targets, targets, (size_t)T * sizeof(int32_t));
        free(targets);
    }
    return n_valid;
}

void model_stage_forward(struct model *m, int slot, const int32_t *ids_host, const int32_t *labels_host,
                         struct model_step_out *out)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, V = m->V, l0 = m->st.layer0, l1 = m->st.layer1;
    model_use_slot(m, slot);
    out->ce_sum = 0;
    out->n_valid = upload_batch(m, ids_host, labels_host);
    void *first_in = l1 > l0 ? m->layers[l0].h_in : m->h_final;
    if (m->st.first) {
        int emb = weight_index(m, TR_EMBED, -1);
        hook(m, HOOK_BEFORE_FWD, 0);
        be->embedding_forward(first_in, m->ids, model_weight(m, emb), T, H);
        hook(m, HOOK_AFTER_FWD, 0);
    }
    if (m->E > 0) be->zero(m->stats, (size_t)m->L * 2 * m->E * sizeof(float));
    for (int l = l0; l < l1; l++) {
        hook(m, HOOK_BEFORE_FWD, 1 + l);
        attention_forward(m, l);
        mlp_forward(m, l, l + 1 < l1 ? m->layers[l + 1].h_in : m->h_final);
        hook(m, HOOK_AFTER_FWD, 1 + l);
    }
    if (m->st.last) {
        int fn = weight_index(m, TR_FINAL_NORM, -1);
        head_hook(m, HOOK_BEFORE_FWD);
        be->rmsnorm_forward(m->hf, m->rstd_f, m->h_final, model_weight(m, fn), T, H,
                            (float)m->cfg.rms_norm_eps);
        be->matmul_forward(m->logits, m->hf, model_weight(m, head_index(m)), T, H, V);
        head_hook(m, HOOK_AFTER_FWD);
        if (m->ce_fused_scale > 0) {
            be->cross_entropy_fused(m->losses, m->lse_f, m->logits, m->targets, T, V, m->ce_fused_scale);
            m->dlogits_scale = m->ce_fused_scale;
        } else {
            be->cross_entropy_forward(m->losses, m->lse_f, m->logits, m->targets, T, V);
            m->dlogits_scale = 0.0f;
        }
    }
    if (m->defer_losses || m->defer_stats) {
        if (m->st.last && m->defer_losses) be->copy(m->defer_losses, m->losses, (size_t)T * sizeof(float));
        if (m->E > 0 && m->defer_stats) be->copy(m->defer_stats, m->stats, (size_t)m->L * 2 * m->E * sizeof(float));
        return;
    }
    if (m->st.last) {
        float *losses = mt_malloc((size_t)T * sizeof(float));
        be->download(losses, m->losses, (size_t)T * sizeof(float));
        double sum = 0;
        for (int t = 0; t < T; t++) sum += losses[t];
        free(losses);
        out->ce_sum = sum;
    }
    if (m->E > 0)
        be->download(m->stats_h, m->stats, (size_t)m->L * 2 * m->E * sizeof(float));
}

void model_arm_loss_gradient(struct model *m, float ce_scale)
{
    m->ce_fused_scale = mt_env_flag("MT_UNFUSED_LOSS") ? 0.0f : ce_scale;
}

void model_disarm_loss_gradient(struct model *m) { m->ce_fused_scale = 0.0f; }

void model_stage_backward(struct model *m, int slot, float ce_scale, const float *aux_dp_host)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, V = m->V, l0 = m->st.layer0, l1 = m->st.layer1;
    model_use_slot(m, slot);
    m->aux_active = m->E > 0 && (aux_dp_host != NULL || m->aux_dp_ready);
    if (m->E > 0 && aux_dp_host) be->upload(m->aux_dp, aux_dp_host, (size_t)m->E * sizeof(float));
    m->aux_dp_ready = false;
    if (m->st.last) {
        /* dlogits overwrite the logits: they are not needed after this point */
        if (m->dlogits_scale > 0)
            MT_CHECK(m->dlogits_scale == ce_scale, "loss gradient computed with scale %g, backward asks %g",
                     (double)m->dlogits_scale, (double)ce_scale);
        else
            be->cross_entropy_backward(m->logits, m->logits, m->lse_f, m->targets, T, V, ce_scale);
        m->dlogits_scale = 0.0f;
        int head = head_index(m), fn = weight_index(m, TR_FINAL_NORM, -1);
        head_hook(m, HOOK_BEFORE_BWD);
        be->matmul_backward(m->d_t1, model_grad(m, head), m->logits, m->hf, model_weight(m, head), T, H,
                            V, false);
        be->rmsnorm_backward(m->d_h, model_grad(m, fn), m->d_t1, m->h_final, model_weight(m, fn),
                             m->rstd_f, T, H, false);
        head_hook(m, HOOK_AFTER_BWD);
    }
    for (int l = l1 - 1; l >= l0; l--) {
        hook(m, HOOK_BEFORE_BWD, 1 + l);
        if (m->recompute) {
            /* rebuild layer l's activations from its saved input; the layer output is not needed
             * (d_t2 is free until attention_backward) */
            m->recomputing = true;
            attention_forward(m, l);
            mlp_forward(m, l, m->d_t2);
            m->recomputing = false;
        }
        mlp_backward(m, l);
        attention_backward(m, l);
        hook(m, HOOK_AFTER_BWD, 1 + l);
    }
    model_run_deferred_wgrads(m, -1);
    if (m->st.first) {
        int emb = weight_index(m, TR_EMBED, -1);
        hook(m, HOOK_BEFORE_BWD, 0);
        be->embedding_backward(model_grad(m, emb), m->d_h, m->ids, T, H);
        hook(m, HOOK_AFTER_BWD, 0);
    }
    /* the step's last backward must have added every waiting expert weight gradient */
    MT_CHECK(m->more_backwards || !model_expert_wgrad_pending(m),
             "expert weight gradients left waiting after the step's last backward");
    m->more_backwards = false;
}

void model_forward(struct model *m, const int32_t *ids_host, const int32_t *labels_host,
                   struct model_step_out *out)
{
    MT_CHECK(m->st.first && m->st.last, "model_forward runs a whole model (this is one stage)");
    model_stage_forward(m, 0, ids_host, labels_host, out);
}

void model_backward(struct model *m, float ce_scale, const float *aux_dp_host)
{
    model_stage_backward(m, 0, ce_scale, aux_dp_host);
}
