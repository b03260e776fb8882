/* The MLP half of a decoder layer. MoE layers: router, top-k, dispatch of token rows to the EP
 * ranks that hold their experts (moe_dispatch.c), grouped expert SwiGLU, the reverse exchange and
 * the weighted combine. Dense layers (mlp_only_layers / decoder_sparse_step): one SwiGLU MLP.
 * parallel.moe_chunks > 1 runs the layer's exchange in chunks that overlap the expert GEMMs
 * (moe_exchange.c); 1 is the path below.
 * Each token's k choices are re-sorted by ascending expert id before anything uses them, so the
 * combine adds expert outputs in ascending expert order (transformers' eager order; across ranks
 * the per-rank partial sums are added in rank order, so meshes agree to rounding). */

#include "common.h"
#include "layer.h"
#include "model.h"
#include "moe_buffers.h"
#include "moe_dispatch.h"
#include "moe_exchange.h"
#include "moe_wgrad_jobs.h"
#include "route_replay.h"
#include "router_opts.h"

/* the expert-side rows a layer uses, in backend memory (its route plan's last offset): R_exp
 * itself, but for the fixed exchange's plans, whose R_exp is the buffers' capacity */
static const int64_t *used_rows(const struct model *m, const struct moe_route *r)
{
    return r->expert_off + m->n_local_experts;
}

/* out = resid + the dense MLP of the normed rows */
static void dense_mlp_forward(struct model *m, struct layer_acts *a, int l, void *out,
                              const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, Id = m->Id;
    be->matmul_forward(a->gu, a->m, weight_of(m, TR_MLP_GATE_UP, l), T, H, 2 * Id);
    be->swiglu_forward(a->act, a->gu, T, Id, NULL);
    be->matmul_forward_residual(out, a->act, weight_of(m, TR_MLP_DOWN, l), resid, T, Id, H);
}

static void dense_mlp_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, Id = m->Id;
    be->matmul_backward(m->d_act, grad_of(m, TR_MLP_DOWN, l), m->d_h, a->act, weight_of(m, TR_MLP_DOWN, l), T, Id,
                        H, false);
    be->swiglu_backward(m->d_gu, m->d_act, a->gu, T, Id, NULL);
    be->matmul_backward(m->d_t1, grad_of(m, TR_MLP_GATE_UP, l), m->d_gu, a->m, weight_of(m, TR_MLP_GATE_UP, l), T,
                        H, 2 * Id, false);
}

/* From the layer's top-k (a->topk_idx/topk_w) and norm output (a->m) to the experts' weighted sum
 * `out` (+ resid unless NULL): route plan, dispatch, expert SwiGLU, combine (in chunks when
 * parallel.moe_chunks > 1). */
static void experts_forward(struct model *m, struct layer_acts *a, int l, void *out, const void *resid,
                            struct token_rows *early)
{
    const struct backend *be = m->be;
    const int H = m->H, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    if (m->moe_chunks > 1) {
        moe_exchange_forward(m, a, l, out, resid);
        return;
    }
    moe_route_layer(m, a, l);
    moe_dispatch_rows(m, a, early);
    be->expert_matmul_forward(a->gu, a->x_exp, weight_of(m, TR_EXP_GATE_UP, l), r->expert_off, NULL, r->R_exp, nl,
                              H, 2 * I);
    be->swiglu_forward(a->act, a->gu, (int)r->R_exp, I, used_rows(m, r));
    if (m->pairs && m->combine_self_last) {
        moe_down_and_combine_self_last(m, a, l, out, resid);
        return;
    }
    be->expert_matmul_forward(a->y_exp, a->act, weight_of(m, TR_EXP_DOWN, l), r->expert_off, NULL, r->R_exp, nl, I,
                              H);
    moe_combine_rows(m, a, out, resid);
}

/* Its backward: m->d_h (dL/d out) -> m->d_t1 (through the experts), m->d_topk_w and the experts'
 * weight gradients. */
/* Where an overwriting grouped weight gradient (the step's only pass over that dw) leaves its Σ dw²
 * for the gradient norm (model.h model_grad_sumsq_slot). An adding pass's sum would cost a read of
 * dw like the norm's own pass, so it takes none. */
static double *sumsq_slot(struct model *m, bool overwrite, enum tensor_role r, int l)
{
    return overwrite ? model_grad_sumsq_slot(m, r, l) : NULL;
}

static void experts_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int H = m->H, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    if (m->moe_chunks > 1) {
        moe_exchange_backward(m, a, l);
        return;
    }
    float *dw_down = grad_of(m, TR_EXP_DOWN, l), *dw_gu = grad_of(m, TR_EXP_GATE_UP, l);
    /* parallel.expert_wgrad_pairs / expert_wgrad_group: this micro-step's weight gradients wait
     * for a later one's (stashed while the group has room and another backward follows), or the
     * waiting ones join this micro-step's in one pass over dw (grouped, stash first) */
    struct expert_wgrad_stash *s = m->wstash && m->wstash[l].n_slots ? &m->wstash[l] : NULL;
    /* a job this layer queued in its last backward finishes first: its slots are the stash's */
    /* a stash parking in place (expert_wgrad_stash.direct): this micro-step's output gradients
     * go straight to the slot its rows are in (the scratch comes back at the end) */
    void *const scratch_gu = m->d_gu, *const scratch_dy = m->d_y_exp;
    const bool in_place = s && s->direct && s->pending < s->n_used;
    if (in_place) {
        MT_CHECK(a->x_exp == s->slot[s->pending].x_exp, "layer %d: its forward did not park its rows in place", l);
        m->d_gu = s->slot[s->pending].d_gu;
        m->d_y_exp = s->slot[s->pending].d_y_exp;
    }
    struct comm_p2p_req w_req;
    const float *d_w = moe_combine_rows_backward(m, a, l, &w_req);
    moe_wgrad_job_finish(m, l); /* without pairs (no jobs then: a no-op) */
    const bool stashed = s && s->pending < s->n_slots && m->more_backwards && dw_down && dw_gu;
    const bool grouped = s && s->pending > 0 && !stashed;
    /* a grouped micro-step's weight gradients become a job (moe_wgrad_jobs.h) while another
     * backward follows, to fill later exchanges' waits */
    const bool queued = grouped && m->wgrad_jobs && m->more_backwards;
    const bool now = !grouped && !stashed;
    const bool fresh = m->exp_dw_fresh[l];
    if (!stashed) m->exp_dw_fresh[l] = false;
    const int64_t R = r->R_exp;
    struct expert_rows sets[MT_WGRAD_MAX_SETS];
    const int n_sets = grouped ? s->pending + 1 : 0;
    /* A step of one micro-step (no group) overwrites dw in this backward alone: its weight
     * gradient then runs as the grouped call of one set (the same kernel and bits on the GPU),
     * which leaves Σ dw² for the gradient norm (model_grad_sumsq_slot) */
    double *ss_down = now && dw_down ? sumsq_slot(m, fresh, TR_EXP_DOWN, l) : NULL;
    be->expert_matmul_backward(m->d_act, now && !ss_down ? dw_down : NULL, m->d_y_exp, a->act,
                               weight_of(m, TR_EXP_DOWN, l), r->expert_off, R, nl, I, H, fresh);
    if (ss_down)
        be->expert_matmul_wgrad_sets(dw_down, &(struct expert_rows){m->d_y_exp, a->act, r->expert_off, R}, 1, nl,
                                     I, H, true, ss_down);
    if (grouped && !queued) {
        for (int k = 0; k < s->pending; k++)
            sets[k] = (struct expert_rows){s->slot[k].d_y_exp, s->slot[k].act, s->slot[k].off, s->slot[k].rows};
        sets[s->pending] = (struct expert_rows){m->d_y_exp, a->act, r->expert_off, R};
        be->expert_matmul_wgrad_sets(dw_down, sets, n_sets, nl, I, H, fresh, sumsq_slot(m, fresh, TR_EXP_DOWN, l));
    }
    be->swiglu_backward(m->d_gu, m->d_act, a->gu, (int)R, I, used_rows(m, r));
    double *ss_gu = now && dw_gu ? sumsq_slot(m, fresh, TR_EXP_GATE_UP, l) : NULL;
    be->expert_matmul_backward(m->d_x_exp, now && !ss_gu ? dw_gu : NULL, m->d_gu, a->x_exp,
                               weight_of(m, TR_EXP_GATE_UP, l), r->expert_off, R, nl, H, 2 * I, fresh);
    if (ss_gu)
        be->expert_matmul_wgrad_sets(dw_gu, &(struct expert_rows){m->d_gu, a->x_exp, r->expert_off, R}, 1, nl, H,
                                     2 * I, true, ss_gu);
    /* parking swaps d_y_exp out before the send half reuses it; the grouped gate_up weight
     * gradient (reads d_gu and x_exp) runs while d_x_exp's pair rows move to their tokens' ranks */
    moe_combine_weights_home(m, a, d_w, &w_req); /* before the next inbox exchange */
    if (stashed || queued) moe_stash_expert_rows(m, a, s);
    /* the parked output gradient is complete, and with EP the send half below sums the pairs in
     * the d_y_exp scratch (moe_dispatch_rows_backward_send) */
    if (in_place) m->d_y_exp = scratch_dy;
    if (queued) moe_wgrad_job_queue(m, l, fresh);
    struct comm_p2p_req req;
    const void *d_pairs = moe_dispatch_rows_backward_send(m, a, &req);
    if (m->pairs) model_run_deferred_wgrads(m, 1); /* the layer above's q_proj weight gradient */
    if (grouped && !queued) {
        for (int k = 0; k < s->pending; k++)
            sets[k] = (struct expert_rows){s->slot[k].d_gu, s->slot[k].x_exp, s->slot[k].off, s->slot[k].rows};
        sets[s->pending] = (struct expert_rows){m->d_gu, a->x_exp, r->expert_off, R};
        be->expert_matmul_wgrad_sets(dw_gu, sets, n_sets, nl, H, 2 * I, fresh,
                                     sumsq_slot(m, fresh, TR_EXP_GATE_UP, l));
        s->pending = 0;
        moe_stash_point_rows(a, s);
    }
    moe_dispatch_rows_backward_sum(m, a, d_pairs, &req);
    if (in_place) m->d_gu = scratch_gu;
}

static void moe_forward(struct model *m, struct layer_acts *a, int l, void *out, const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, E = m->E, K = m->K;
    struct token_rows early = {0};
    if (moe_rows_by_token(m)) moe_token_rows_start(m, a->m, &early); /* crosses while the router runs */
    if (m->router_f32) {
        be->router_matmul_forward(a->logits, a->m, weight_of(m, TR_ROUTER, l), T, H, E);
    } else { /* transformers' bf16 router: the logits are rounded to bf16, softmax upcasts them */
        be->matmul_forward(m->d_logits_r, a->m, weight_of(m, TR_ROUTER, l), T, H, E);
        be->cast_x_to_f32(a->logits, m->d_logits_r, (size_t)T * E);
    }
    const struct router_opts ro = router_opts_of(&m->cfg);
    be->router_forward(a->topk_idx, a->topk_w, a->probs, a->logits,
                       m->bias ? m->bias + (size_t)l * E : NULL, T, E, K, &ro);
    route_replay_apply(m, l, a->topk_idx, a->topk_w, a->probs); /* data.routing_replay, recompute */
    float *st = m->stats + (size_t)l * 2 * E;
    if (!m->recomputing) be->router_stats(st, st + E, a->probs, a->topk_idx, T, E, K);
    experts_forward(m, a, l, out, resid, moe_rows_by_token(m) ? &early : NULL);
}

static void moe_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, E = m->E, K = m->K;
    experts_backward(m, a, l);
    /* model.train_router false, or weights fixed by a routing file: the routing weights were
     * detached before they scaled the expert outputs, so only the aux term reaches the router */
    if (!m->cfg.train_router || route_replay_weights_fixed(m)) be->zero(m->d_topk_w, (size_t)T * K * sizeof(float));
    /* dlogits overwrite the layer's logits (the forward's last reader was router_forward) */
    const struct router_opts ro = router_opts_of(&m->cfg);
    be->router_backward(a->logits, m->d_topk_w, a->probs, a->topk_idx,
                        m->aux_active ? m->aux_dp : NULL, T, E, K, &ro);
    int ri = tensor_lookup(&m->tt, TR_ROUTER, l);
    float *dwg = m->tt.t[ri].frozen ? NULL : model_grad(m, ri);
    if (m->router_f32) {
        be->router_matmul_backward(m->d_t1, dwg, a->logits, a->m, model_weight(m, ri), T, H, E, true);
    } else {
        be->cast_f32_to_x(m->d_logits_r, a->logits, (size_t)T * E);
        be->matmul_backward(m->d_t1, dwg, m->d_logits_r, a->m, model_weight(m, ri), T, H, E, true);
    }
}

void mlp_forward(struct model *m, int l, void *out)
{
    struct layer_acts *a = model_acts(m, l);
    m->be->rmsnorm_forward(a->m, a->rstd_m, a->h_mid, weight_of(m, TR_MLP_NORM, l), m->T, m->H,
                           (float)m->cfg.rms_norm_eps);
    if (config_layer_is_moe(&m->cfg, l)) {
        moe_forward(m, a, l, out, a->h_mid); /* the residual joins the combine's pass */
    } else {
        dense_mlp_forward(m, a, l, out, a->h_mid);
    }
}

void mlp_backward(struct model *m, int l)
{
    struct layer_acts *a = model_acts(m, l);
    /* both paths leave dL/d(norm output) in d_t1 */
    if (config_layer_is_moe(&m->cfg, l)) moe_backward(m, a, l);
    else dense_mlp_backward(m, a, l);
    m->be->rmsnorm_backward(m->d_h, grad_of(m, TR_MLP_NORM, l), m->d_t1, a->h_mid, weight_of(m, TR_MLP_NORM, l),
                            a->rstd_m, m->T, m->H, true);
}

/* ---- Testing hooks (tests/mpi/dispatch_check.c) ------------------------------------------------
 * The dispatch and combine of MoE layer l driven by a routing the caller chooses instead of the
 * router. Thin wrappers over the functions moe_forward / moe_backward run; the model never calls
 * them. Buffers are backend memory. */

static struct layer_acts *test_layer(struct model *m, int l)
{
    MT_CHECK(l >= 0 && l < m->L && config_layer_is_moe(&m->cfg, l), "layer %d is not an MoE layer", l);
    return model_acts(m, l);
}

static void copy_in(const struct model *m, void *dst, const void *src, int64_t rows)
{
    if (dst != src && rows > 0) m->be->copy(dst, src, (size_t)rows * m->H * m->be->x_size);
}

int64_t moe_dispatch_for_test(struct model *m, int l, const int32_t *topk_idx_host,
                              const float *topk_w_host, const void *x)
{
    struct layer_acts *a = test_layer(m, l);
    const struct backend *be = m->be;
    const size_t tk = (size_t)m->T * m->K;
    be->upload(a->topk_idx, topk_idx_host, tk * sizeof(int32_t));
    be->upload(a->topk_w, topk_w_host, tk * sizeof(float));
    copy_in(m, a->m, x, m->T);
    moe_route_layer(m, a, l);
    moe_dispatch_rows(m, a, NULL);
    return a->route.R_exp;
}

void moe_combine_for_test(struct model *m, int l, const void *y_exp, void *out)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, a->y_exp, y_exp, a->route.R_exp);
    moe_combine_rows(m, a, out, NULL);
}

void moe_combine_backward_for_test(struct model *m, int l, const void *dout)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_h, dout, m->T);
    struct comm_p2p_req w_req;
    const float *d_w = moe_combine_rows_backward(m, a, -1, &w_req);
    moe_combine_weights_home(m, a, d_w, &w_req);
}

void moe_dispatch_backward_for_test(struct model *m, int l, const void *d_x_exp, void *dx)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_x_exp, d_x_exp, a->route.R_exp);
    struct comm_p2p_req req;
    const void *d_pairs = moe_dispatch_rows_backward_send(m, a, &req);
    moe_dispatch_rows_backward_sum(m, a, d_pairs, &req);
    copy_in(m, dx, m->d_t1, m->T);
}

void moe_experts_for_test(struct model *m, int l, const int32_t *topk_idx_host, const float *topk_w_host,
                          const void *x, void *out)
{
    struct layer_acts *a = test_layer(m, l);
    const struct backend *be = m->be;
    const size_t tk = (size_t)m->T * m->K;
    be->upload(a->topk_idx, topk_idx_host, tk * sizeof(int32_t));
    be->upload(a->topk_w, topk_w_host, tk * sizeof(float));
    copy_in(m, a->m, x, m->T);
    experts_forward(m, a, l, out, NULL, NULL);
}

void moe_experts_backward_for_test(struct model *m, int l, const void *dout, void *dx)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_h, dout, m->T);
    experts_backward(m, a, l);
    copy_in(m, dx, m->d_t1, m->T);
}
