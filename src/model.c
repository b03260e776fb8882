#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static void *xalloc(const struct model *m, int64_t n) { return m->be->alloc((size_t)n * m->be->x_size); }
static float *falloc(const struct model *m, int64_t n) { return m->be->alloc((size_t)n * sizeof(float)); }
static int32_t *ialloc(const struct model *m, int64_t n) { return m->be->alloc((size_t)n * sizeof(int32_t)); }

int64_t model_work_numel_of(const struct model *m, int i)
{
    const struct tensor_spec *s = &m->tt.t[i];
    return s->kind == TK_EXPERT ? s->numel / m->ep : s->numel;
}

void *model_weight(const struct model *m, int i)
{
    const struct tensor_spec *s = &m->tt.t[i];
    return MT_XP(m, m->w[tensor_group_of(s)], m->work_off[i]);
}

float *model_grad(const struct model *m, int i) { return m->g[tensor_group_of(&m->tt.t[i])] + m->work_off[i]; }

/* Activations of a layer (all but h_in, which each layer owns). A shared set used by MoE and
 * dense layers alike gets both parts; moe.c grows gu/act to cover both shapes. */
static void alloc_layer(struct model *m, struct layer_acts *a, bool moe, bool dense)
{
    const int64_t T = m->T, H = m->H, D = m->D;
    a->a = xalloc(m, T * H);
    a->rstd_a = falloc(m, T);
    a->q_pre = xalloc(m, T * m->Hq * D);
    a->k_pre = xalloc(m, T * m->Hkv * D);
    a->rstd_q = falloc(m, T * m->Hq);
    a->rstd_k = falloc(m, T * m->Hkv);
    a->q = xalloc(m, T * m->Hq * D);
    a->k = xalloc(m, T * m->Hkv * D);
    a->v = xalloc(m, T * m->Hkv * D);
    a->attn = xalloc(m, T * m->Hq * D);
    a->lse = falloc(m, T * m->Hq);
    a->h_mid = xalloc(m, T * H);
    a->m = xalloc(m, T * H);
    a->rstd_m = falloc(m, T);
    if (moe) {
        const int64_t E = m->E, K = m->K;
        a->logits = falloc(m, T * E);
        a->probs = falloc(m, T * E);
        a->topk_idx = ialloc(m, T * K);
        a->topk_w = falloc(m, T * K);
        struct moe_route *r = &a->route;
        r->expert_off = mt_calloc((size_t)m->n_local_experts + 1, sizeof(int64_t));
        r->send_counts = mt_calloc((size_t)m->ep, sizeof(int64_t));
        r->recv_counts = mt_calloc((size_t)m->ep, sizeof(int64_t));
        if (m->ep == 1) {
            r->exp_src = ialloc(m, T * K);
            r->exp_slot = ialloc(m, T * K);
        } else {
            r->pair_tok = ialloc(m, T * MT_MIN(K, m->ep));
            r->tok_pair = ialloc(m, T * K);
            r->w_map = ialloc(m, T * K);
        }
        /* expert-side buffers (x_exp, gu, act, y_exp) and, with ep > 1, the receiver's pair
         * arrays are sized on demand in moe.c */
    }
    if (dense) {
        a->gu = xalloc(m, T * 2 * m->Id);
        a->act = xalloc(m, T * m->Id);
        a->cap_rows = 0;
    }
}

void model_init(struct model *m, const struct backend *be, const struct model_config *cfg, int B,
                int S, struct comm *ep_comm, bool recompute)
{
    memset(m, 0, sizeof *m);
    m->be = be;
    m->cfg = *cfg;
    m->router_f32 = cfg->router_fp32 || be->x_size == 4;
    tensor_table_build(&m->tt, cfg);
    m->H = cfg->hidden_size;
    m->V = cfg->vocab_size;
    m->D = config_head_dim(cfg);
    m->Hq = cfg->num_attention_heads;
    m->Hkv = cfg->num_key_value_heads;
    m->E = cfg->num_experts;
    m->K = cfg->num_experts_per_tok;
    m->I = cfg->moe_intermediate_size;
    m->Id = cfg->intermediate_size;
    m->L = cfg->num_hidden_layers;
    m->ep_comm = ep_comm;
    m->ep = ep_comm ? ep_comm->size : 1;
    m->ep_rank = ep_comm ? ep_comm->rank : 0;
    m->n_local_experts = m->E > 0 ? m->E / m->ep : 0;
    m->expert0 = m->n_local_experts * m->ep_rank;
    for (int l = 0; l < m->L; l++) m->n_moe_layers += config_layer_is_moe(cfg, l);

    m->work_off = mt_malloc((size_t)m->tt.n * sizeof(int64_t));
    for (int i = 0; i < m->tt.n; i++) {
        enum tensor_group g = tensor_group_of(&m->tt.t[i]);
        m->work_off[i] = m->work_numel[g];
        m->work_numel[g] += model_work_numel_of(m, i);
    }
    for (int g = 0; g < TG_COUNT; g++) {
        m->w[g] = xalloc(m, m->work_numel[g]);
        m->g[g] = falloc(m, m->work_numel[g]);
        be->zero(m->g[g], (size_t)m->work_numel[g] * sizeof(float));
    }

    m->B = B;
    m->S = S;
    m->T = B * S;
    const int64_t T = m->T, H = m->H;
    m->ids = ialloc(m, T);
    m->targets = ialloc(m, T);
    m->pos = ialloc(m, T);
    int32_t *pos = mt_malloc((size_t)T * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(t % S);
    be->upload(m->pos, pos, (size_t)T * sizeof(int32_t));
    free(pos);

    m->recompute = recompute;
    m->layers = mt_calloc((size_t)m->L, sizeof *m->layers);
    bool any_moe = false, any_dense = false;
    for (int l = 0; l < m->L; l++) {
        bool moe = config_layer_is_moe(cfg, l);
        any_moe |= moe;
        any_dense |= !moe;
        m->layers[l].h_in = xalloc(m, T * H);
        if (!recompute) alloc_layer(m, &m->layers[l], moe, !moe);
    }
    if (recompute) alloc_layer(m, &m->shared, any_moe, any_dense);
    m->h_final = xalloc(m, T * H);
    m->hf = xalloc(m, T * H);
    m->rstd_f = falloc(m, T);
    m->logits = xalloc(m, T * m->V);
    m->losses = falloc(m, T);
    m->lse_f = falloc(m, T);

    int64_t wide = MT_MAX(H, (int64_t)m->Hq * m->D);
    m->d_h = xalloc(m, T * H);
    m->d_t1 = xalloc(m, T * wide);
    m->d_t2 = xalloc(m, T * wide);
    m->d_t3 = xalloc(m, T * wide);
    m->d_q = xalloc(m, T * m->Hq * m->D);
    m->d_k = xalloc(m, T * m->Hkv * m->D);
    m->d_v = xalloc(m, T * m->Hkv * m->D);
    if (m->E > 0) {
        m->d_logits_r = xalloc(m, T * m->E);
        m->d_topk_w = falloc(m, T * m->K);
        m->aux_dp = falloc(m, m->E);
        if (m->ep > 1) {
            const int64_t P = T * MT_MIN(m->K, m->ep);
            m->d_x_send = xalloc(m, P * H);
            m->meta_idx_send = ialloc(m, P * m->K);
            m->meta_w_send = falloc(m, P * m->K);
        }
        model_ensure_ones(m, T * m->K);
    }
    /* dense-MLP layers use d_gu/d_act at [T, 2 Id]; MoE layers grow them on demand (moe.c) */
    m->d_gu = xalloc(m, T * MT_MAX((int64_t)2 * m->Id, 1));
    m->d_act = xalloc(m, T * MT_MAX((int64_t)m->Id, 1));
    m->d_cap_rows = 0;
    int64_t nstat = (int64_t)m->L * 2 * MT_MAX(m->E, 1);
    m->stats = falloc(m, nstat);
    m->stats_h = mt_calloc((size_t)nstat, sizeof(float));
}

void model_ensure_ones(struct model *m, int64_t n)
{
    if (n <= m->ones_cap) return;
    int64_t cap = n + n / 4 + 16;
    float *ones = mt_malloc((size_t)cap * sizeof(float));
    for (int64_t i = 0; i < cap; i++) ones[i] = 1.0f;
    if (m->ones) m->be->free(m->ones);
    m->ones = falloc(m, cap);
    m->be->upload(m->ones, ones, (size_t)cap * sizeof(float));
    free(ones);
    m->ones_cap = cap;
}

struct layer_acts *model_acts(struct model *m, int l)
{
    if (!m->recompute) return &m->layers[l];
    m->shared.h_in = m->layers[l].h_in;
    return &m->shared;
}

static void free_layer(const struct model *m, struct layer_acts *a)
{
    const struct backend *be = m->be;
    void *dev[] = {a->h_in, a->a, a->rstd_a, a->q_pre, a->k_pre, a->rstd_q, a->rstd_k, a->q, a->k,
                   a->v, a->attn, a->lse, a->h_mid, a->m, a->rstd_m, a->logits, a->probs,
                   a->topk_idx, a->topk_w, a->x_exp, a->gu, a->act, a->y_exp,
                   a->route.pair_tok, a->route.tok_pair, a->route.w_map, a->route.exp_src,
                   a->route.exp_slot};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->free(dev[i]);
    struct moe_route *r = &a->route;
    if (m->ep > 1) { /* with ep = 1 they are the layer's topk_idx/topk_w */
        if (r->meta_idx) be->free(r->meta_idx);
        if (r->meta_w) be->free(r->meta_w);
    }
    free(r->expert_off);
    free(r->send_counts);
    free(r->recv_counts);
}

void model_free(struct model *m)
{
    const struct backend *be = m->be;
    for (int l = 0; l < m->L; l++) free_layer(m, &m->layers[l]);
    if (m->recompute) {
        m->shared.h_in = NULL; /* owned by a layer, freed above */
        free_layer(m, &m->shared);
    }
    free(m->layers);
    for (int g = 0; g < TG_COUNT; g++) {
        be->free(m->w[g]);
        be->free(m->g[g]);
    }
    void *dev[] = {m->ids, m->targets, m->pos, m->h_final, m->hf, m->rstd_f, m->logits, m->losses,
                   m->lse_f,
                   m->d_h, m->d_t1, m->d_t2, m->d_t3, m->d_q, m->d_k, m->d_v, m->d_logits_r,
                   m->d_topk_w, m->d_x_send, m->meta_idx_send, m->meta_w_send, m->d_w_recv,
                   m->aux_dp, m->ones, m->d_gu, m->d_act, m->d_x_exp, m->d_y_exp,
                   m->stats, m->bias, m->seg};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->free(dev[i]);
    free(m->stats_h);
    free(m->work_off);
    tensor_table_free(&m->tt);
    memset(m, 0, sizeof *m);
}

void model_zero_grad(struct model *m)
{
    for (int g = 0; g < TG_COUNT; g++)
        m->be->zero(m->g[g], (size_t)m->work_numel[g] * sizeof(float));
}

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

void model_forward(struct model *m, const int32_t *ids_host, const int32_t *labels_host,
                   struct model_step_out *out)
{
    const struct backend *be = m->be;
    const int T = m->T, S = m->S, H = m->H, V = m->V;
    const int32_t *labels = labels_host ? labels_host : ids_host;
    int32_t *targets = mt_malloc((size_t)T * sizeof(int32_t));
    int64_t n_valid = 0;
    for (int t = 0; t < T; t++) {
        bool last = (t % S) == S - 1;
        targets[t] = last ? MT_IGNORE_INDEX : labels[t + 1];
        if (targets[t] != MT_IGNORE_INDEX) {
            MT_CHECK(targets[t] >= 0 && targets[t] < V, "label %d out of range [0, %d)", targets[t], V);
            n_valid++;
        }
        MT_CHECK(ids_host[t] >= 0 && ids_host[t] < V, "token id %d out of range [0, %d)", ids_host[t], V);
    }
    be->upload(m->ids, ids_host, (size_t)T * sizeof(int32_t));
    be->upload(m->targets, targets, (size_t)T * sizeof(int32_t));
    free(targets);

    int emb = weight_index(m, TR_EMBED, -1);
    be->embedding_forward(m->layers[0].h_in, m->ids, model_weight(m, emb), T, H);
    if (m->E > 0) be->zero(m->stats, (size_t)m->L * 2 * m->E * sizeof(float));
    for (int l = 0; l < m->L; l++) {
        attention_forward(m, l);
        mlp_forward(m, l, l + 1 < m->L ? m->layers[l + 1].h_in : m->h_final);
    }
    int fn = weight_index(m, TR_FINAL_NORM, -1);
    be->rmsnorm_forward(m->hf, m->rstd_f, m->h_final, model_weight(m, fn), T, H,
                        (float)m->cfg.rms_norm_eps);
    be->matmul_forward(m->logits, m->hf, model_weight(m, head_index(m)), T, H, V);
    be->cross_entropy_forward(m->losses, m->lse_f, m->logits, m->targets, T, V);

    float *losses = mt_malloc((size_t)T * sizeof(float));
    be->download(losses, m->losses, (size_t)T * sizeof(float));
    double sum = 0;
    for (int t = 0; t < T; t++) sum += losses[t];
    free(losses);
    if (m->E > 0)
        be->download(m->stats_h, m->stats, (size_t)m->L * 2 * m->E * sizeof(float));
    out->ce_sum = sum;
    out->n_valid = n_valid;
}

void model_backward(struct model *m, float ce_scale, const float *aux_dp_host)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, V = m->V;
    m->aux_active = m->E > 0 && aux_dp_host != NULL;
    if (m->aux_active) be->upload(m->aux_dp, aux_dp_host, (size_t)m->E * sizeof(float));
    /* dlogits overwrite the logits: they are not needed after this point */
    be->cross_entropy_backward(m->logits, m->logits, m->lse_f, m->targets, T, V, ce_scale);
    int head = head_index(m);
    be->matmul_backward(m->d_t1, model_grad(m, head), m->logits, m->hf, model_weight(m, head), T, H,
                        V, false);
    int fn = weight_index(m, TR_FINAL_NORM, -1);
    be->rmsnorm_backward(m->d_h, model_grad(m, fn), m->d_t1, m->h_final, model_weight(m, fn),
                         m->rstd_f, T, H, false);
    for (int l = m->L - 1; l >= 0; l--) {
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
    }
    int emb = weight_index(m, TR_EMBED, -1);
    be->embedding_backward(model_grad(m, emb), m->d_h, m->ids, T, H);
}
