#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "env_flag.h"
#include "moe_timeline.h"
#include "mem_track.h"

static void *xalloc(const struct model *m, int64_t n) { return m->be->alloc((size_t)n * m->be->x_size); }
static float *falloc(const struct model *m, int64_t n) { return m->be->alloc((size_t)n * sizeof(float)); }
static int32_t *ialloc(const struct model *m, int64_t n) { return m->be->alloc((size_t)n * sizeof(int32_t)); }

int64_t model_work_numel_of(const struct model *m, int i)
{
    const struct tensor_spec *s = &m->tt.t[i];
    return s->kind == TK_EXPERT ? s->numel / m->ep : s->numel;
}

void *model_weight(const struct model *m, int i) { return m->wp[i]; }
float *model_grad(const struct model *m, int i) { return m->gp[i]; }

bool model_has_tensor(const struct model *m, int i)
{
    const struct tensor_spec *s = &m->tt.t[i];
    if (s->layer >= 0) return s->layer >= m->st.layer0 && s->layer < m->st.layer1;
    /* a tied embedding is also the last stage's head */
    if (s->role == TR_EMBED) return m->st.first || (m->st.last && m->cfg.tie_word_embeddings);
    return m->st.last;
}

void model_bind(struct model *m, int i, void *w, float *g)
{
    m->wp[i] = w;
    m->gp[i] = g;
}

void model_own_weights(struct model *m)
{
    int64_t n = 0;
    for (int i = 0; i < m->tt.n; i++)
        if (model_has_tensor(m, i)) n += model_work_numel_of(m, i);
    enum mem_cat was = mem_track_set(MEM_WEIGHTS);
    m->own_w = xalloc(m, MT_MAX(n, 1));
    mem_track_set(MEM_GRADS);
    m->own_g = falloc(m, MT_MAX(n, 1));
    mem_track_set(was);
    m->be->zero(m->own_g, (size_t)MT_MAX(n, 1) * sizeof(float));
    int64_t off = 0;
    for (int i = 0; i < m->tt.n; i++) {
        if (!model_has_tensor(m, i)) continue;
        model_bind(m, i, MT_XP(m, m->own_w, off), m->own_g + off);
        off += model_work_numel_of(m, i);
    }
}

void model_set_hooks(struct model *m, const struct model_unit_hooks *h) { m->hooks = h ? *h : (struct model_unit_hooks){0}; }

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
        r->expert_off = m->be->alloc(((size_t)m->n_local_experts + 1) * sizeof(int64_t));
        r->send_counts = mt_calloc((size_t)m->ep, sizeof(int64_t));
        r->recv_counts = mt_calloc((size_t)m->ep, sizeof(int64_t));
        if (!m->pairs) {
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

static void alloc_slot(struct model *m, struct model_slot *sl)
{
    const int64_t T = m->T;
    sl->ids = ialloc(m, T);
    sl->targets = ialloc(m, T);
    sl->pos = ialloc(m, T);
    int32_t *pos = mt_malloc((size_t)T * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(t % m->S);
    m->be->upload(sl->pos, pos, (size_t)T * sizeof(int32_t));
    free(pos);
    sl->layers = mt_calloc((size_t)m->L, sizeof *sl->layers);
    for (int l = m->st.layer0; l < m->st.layer1; l++) {
        bool moe = config_layer_is_moe(&m->cfg, l);
        sl->layers[l].h_in = xalloc(m, T * m->H);
        if (!m->recompute) alloc_layer(m, &sl->layers[l], moe, !moe);
    }
    sl->h_out = xalloc(m, T * m->H);
}

void model_init(struct model *m, const struct backend *be, const struct model_config *cfg, int B,
                int S, struct comm *ep_comm, bool recompute)
{
    struct model_stage whole = {0, cfg->num_hidden_layers, true, true, 1};
    model_init_stage(m, be, cfg, B, S, ep_comm, recompute, &whole);
}

void model_init_stage(struct model *m, const struct backend *be, const struct model_config *cfg,
                      int B, int S, struct comm *ep_comm, bool recompute, const struct model_stage *st)
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
    m->st = *st;
    MT_CHECK(st->layer0 >= 0 && st->layer0 <= st->layer1 && st->layer1 <= m->L && st->n_slots >= 1,
             "model stage: layers [%d, %d) of %d, %d slots", st->layer0, st->layer1, m->L, st->n_slots);
    m->ep_comm = ep_comm;
    m->ep = ep_comm ? ep_comm->size : 1;
    m->pairs = m->ep > 1 || mt_env_flag("MT_MOE_LOOPBACK");
    static const char *const dispatch_ways[] = {"slot", "gather"};
    m->dispatch_by_gather = mt_env_choice("MT_MOE_DISPATCH", dispatch_ways, 2, 0) == 1;
    (void)moe_timeline_enabled(); /* a bad MT_MOE_TIMELINE stops the run here, not at its end */
    m->moe_chunks = 1;
    m->ep_rank = ep_comm ? ep_comm->rank : 0;
    m->n_local_experts = m->E > 0 ? m->E / m->ep : 0;
    m->expert0 = m->n_local_experts * m->ep_rank;
    for (int l = 0; l < m->L; l++) m->n_moe_layers += config_layer_is_moe(cfg, l);
    m->wp = mt_calloc((size_t)m->tt.n, sizeof *m->wp);
    m->gp = mt_calloc((size_t)m->tt.n, sizeof *m->gp);
    m->exp_dw_fresh = mt_calloc((size_t)MT_MAX(m->L, 1), sizeof *m->exp_dw_fresh);

    m->B = B;
    m->S = S;
    m->T = B * S;
    const int64_t T = m->T, H = m->H;
    m->recompute = recompute;
    const enum mem_cat was = mem_track_set(MEM_ACTS);
    m->slots = mt_calloc((size_t)st->n_slots, sizeof *m->slots);
    for (int k = 0; k < st->n_slots; k++) alloc_slot(m, &m->slots[k]);
    bool any_moe = false, any_dense = false;
    for (int l = st->layer0; l < st->layer1; l++) {
        bool moe = config_layer_is_moe(cfg, l);
        any_moe |= moe;
        any_dense |= !moe;
    }
    if (recompute) alloc_layer(m, &m->shared, any_moe, any_dense);
    model_use_slot(m, 0);
    if (st->last) {
        m->hf = xalloc(m, T * H);
        m->rstd_f = falloc(m, T);
        m->logits = xalloc(m, T * m->V);
        m->losses = falloc(m, T);
        m->lse_f = falloc(m, T);
    }

    mem_track_set(MEM_BUFFERS);
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
        if (m->pairs) {
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
    mem_track_set(was);
}

void model_use_slot(struct model *m, int slot)
{
    MT_CHECK(slot >= 0 && slot < m->st.n_slots, "micro-batch slot %d of %d", slot, m->st.n_slots);
    struct model_slot *sl = &m->slots[slot];
    m->slot = slot;
    m->ids = sl->ids;
    m->targets = sl->targets;
    m->pos = sl->pos;
    m->seg = sl->seg;
    m->layers = sl->layers;
    m->h_final = sl->h_out;
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
                   a->route.exp_slot, a->route.expert_off, a->route.chunk_off};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->free(dev[i]);
    struct moe_route *r = &a->route;
    if (m->pairs) { /* otherwise they are the layer's topk_idx/topk_w */
        if (r->meta_idx) be->free(r->meta_idx);
        if (r->meta_w) be->free(r->meta_w);
    }
    free(r->chunks);
    free(r->send_counts);
    free(r->recv_counts);
}

/* the stash of parked expert rows (moe_buffers.c allocates it) */
static void free_expert_wgrad_stash(struct model *m)
{
    if (!m->wstash) return;
    for (int l = 0; l < m->L; l++) {
        for (int k = 0; k < MT_WGRAD_MAX_SETS; k++) {
            struct expert_rows_parked *p = &m->wstash[l].slot[k];
            void *bufs[] = {p->x_exp, p->act, p->d_gu, p->d_y_exp, p->off};
            for (int i = 0; i < 5; i++)
                if (bufs[i] && !(p->in_grads >> i & 1)) m->be->free(bufs[i]);
        }
        if (m->wstash[l].cursor) m->be->free(m->wstash[l].cursor);
    }
    free(m->wstash);
    m->wstash = NULL;
}

void model_free(struct model *m)
{
    const struct backend *be = m->be;
    /* a layer parking in place may point at a slot's rows: its own buffers are the ones to free */
    for (int l = 0; m->wstash && l < m->L; l++)
        if (m->wstash[l].direct) {
            m->slots[0].layers[l].x_exp = m->wstash[l].own_x;
            m->slots[0].layers[l].act = m->wstash[l].own_act;
        }
    for (int k = 0; k < m->st.n_slots; k++) {
        struct model_slot *sl = &m->slots[k];
        for (int l = m->st.layer0; l < m->st.layer1; l++) free_layer(m, &sl->layers[l]);
        void *dev[] = {sl->ids, sl->targets, sl->pos, sl->h_out};
        for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) be->free(dev[i]);
        if (sl->seg) be->free(sl->seg);
        free(sl->layers);
    }
    free(m->slots);
    if (m->recompute) {
        m->shared.h_in = NULL; /* owned by a layer, freed above */
        free_layer(m, &m->shared);
    }
    void *dev[] = {m->own_w, m->own_g, m->hf, m->rstd_f, m->logits, m->losses, m->lse_f,
                   m->d_h, m->d_t1, m->d_t2, m->d_t3, m->d_q, m->d_k, m->d_v, m->d_logits_r,
                   m->d_topk_w, m->d_x_send, m->meta_idx_send, m->meta_w_send, m->d_w_recv,
                   m->aux_dp, m->ones, m->d_gu, m->d_act, m->d_x_exp, m->d_y_exp,
                   m->stats, m->bias, m->x_recv, m->d_w_home, m->o_wgrad_dout,
                   m->q_wgrad_dout, m->rows_need, m->rows_split, m->grad_sumsq};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->free(dev[i]);
    free(m->rows_cap);
    if (m->replay_free) m->replay_free(m);
    free(m->stats_h);
    free(m->wp);
    free(m->gp);
    free_expert_wgrad_stash(m);
    free(m->exp_dw_fresh);
    free(m->grad_sumsq_taken);
    tensor_table_free(&m->tt);
    memset(m, 0, sizeof *m);
}

/* ---- weight gradients held back within a backward (model.h model_enable_deferred_wgrads); the
 * layer passes queue and run them, model_step.c runs what is left at a backward's end */

void model_enable_deferred_wgrads(struct model *m)
{
    const size_t x = m->be->x_size;
    if (!m->o_wgrad_dout) m->o_wgrad_dout = m->be->alloc((size_t)m->T * m->H * x);
    if (!m->q_wgrad_dout) m->q_wgrad_dout = m->be->alloc((size_t)m->T * m->Hq * m->D * x);
}

void model_defer_wgrad(struct model *m, const struct deferred_wgrad *d)
{
    const int cap = (int)(sizeof m->deferred / sizeof m->deferred[0]);
    MT_CHECK(m->n_deferred < cap, "model_defer_wgrad: %d weight gradients already wait", m->n_deferred);
    m->deferred[m->n_deferred++] = *d;
}

void model_run_deferred_wgrads(struct model *m, int max)
{
    int n = max < 0 || max > m->n_deferred ? m->n_deferred : max;
    for (int i = 0; i < n; i++) {
        const struct deferred_wgrad *d = &m->deferred[i];
        m->be->matmul_backward(NULL, d->dw, d->dout, d->in, NULL, d->N, d->I, d->O, false);
    }
    for (int i = n; i < m->n_deferred; i++) m->deferred[i - n] = m->deferred[i];
    m->n_deferred -= n;
}

bool model_skip_expert_grad_zeroing(struct model *m, int unit, int64_t work_numel)
{
    const int l = unit - 1;
    if (l < m->st.layer0 || l >= m->st.layer1 || !config_layer_is_moe(&m->cfg, l)) return false;
    const int gu = tensor_lookup(&m->tt, TR_EXP_GATE_UP, l), down = tensor_lookup(&m->tt, TR_EXP_DOWN, l);
    if (gu < 0 || down < 0) return false;
    if (model_work_numel_of(m, gu) + model_work_numel_of(m, down) != work_numel) return false;
    m->exp_dw_fresh[l] = true;
    return true;
}

void model_zero_grad(struct model *m)
{
    for (int i = 0; i < m->tt.n; i++)
        if (m->gp[i]) m->be->zero(m->gp[i], (size_t)model_work_numel_of(m, i) * sizeof(float));
}

void *model_stage_input(struct model *m, int slot)
{
    return m->st.first || m->st.layer1 == m->st.layer0 ? NULL : m->slots[slot].layers[m->st.layer0].h_in;
}

void *model_stage_output(struct model *m, int slot) { return m->slots[slot].h_out; }

/* ---- sums of squared gradients taken where they are written last (model.h) */

void model_enable_grad_sumsq(struct model *m)
{
    if (m->grad_sumsq) return;
    m->grad_sumsq = m->be->alloc((size_t)m->tt.n * sizeof(double));
    m->grad_sumsq_taken = mt_calloc((size_t)m->tt.n, sizeof(bool));
}

void model_grad_sumsq_reset(struct model *m)
{
    if (m->grad_sumsq_taken) memset(m->grad_sumsq_taken, 0, (size_t)m->tt.n * sizeof(bool));
}

double *model_grad_sumsq_slot(struct model *m, enum tensor_role r, int l)
{
    if (!m->grad_sumsq || m->more_backwards) return NULL;
    const int i = tensor_lookup(&m->tt, r, l);
    if (i < 0) return NULL;
    m->grad_sumsq_taken[i] = true;
    return m->grad_sumsq + i;
}

int model_grad_sumsq_taken(struct model *m, double *h)
{
    int n = 0;
    for (int i = 0; m->grad_sumsq && i < m->tt.n; i++) n += m->grad_sumsq_taken[i];
    if (n == 0) return 0;
    m->be->download(h, m->grad_sumsq, (size_t)m->tt.n * sizeof(double));
    for (int i = 0; i < m->tt.n; i++)
        if (!m->grad_sumsq_taken[i]) h[i] = NAN;
    return n;
}
